"""adaptermesh: an eBPF-aware service mesh for multi-LoRA inference."""

__version__ = "0.1.0"
__all__ = ["__version__"]
