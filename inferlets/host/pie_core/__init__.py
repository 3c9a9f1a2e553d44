"""Pie's ``pie:core`` package on the host, one file per WIT interface."""
