"""The browser page served at ``/ui``: static HTML, CSS and ES modules (no build step,
nothing fetched from outside the server); see ``api/http/routes/ui.py``."""
