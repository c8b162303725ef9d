"""The flash image: resident tensors, a neuron file of quantized bundles, and a manifest (docs/IMAGE_FORMAT.md)."""
