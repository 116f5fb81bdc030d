"""The ComfyUI nodes (V3, comfy_api.latest), each a thin layer over flux2_core; ComfyUI calls live in host.py."""
