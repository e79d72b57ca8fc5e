"""The web UI's static files (no build step). Installed as `localheap.web`; holds no code."""
