"""api.http: the HTTP service (``pie-media serve``)."""
