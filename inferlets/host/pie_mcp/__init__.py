"""Pie's ``pie:mcp`` package on the host."""
