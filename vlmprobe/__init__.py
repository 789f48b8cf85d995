"""vlmprobe: how much GPU memory does this VLM training configuration need, and which knob changes it by how much?"""

__version__ = "0.1.0"
