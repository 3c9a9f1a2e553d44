"""api: the command line (``pie-media``); the HTTP upload API and jobs join it later."""
