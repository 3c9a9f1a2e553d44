"""Who may do what: API keys, tenants, per-key limits, audit lines, and the SSRF-checked
fetch of remote media."""
