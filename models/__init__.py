"""The GPT decoder, written like a single-device model, and its fused-ops seam."""
