"""Pie's ``pie:zo`` package on the host: evolution-strategy updates of adapters."""
