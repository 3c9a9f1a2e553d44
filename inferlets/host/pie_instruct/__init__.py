"""Pie's ``pie:instruct`` package on the host: chat, reasoning and tool-use formats and
decoders from each model's own template and tokens (engine/instruct.py)."""
