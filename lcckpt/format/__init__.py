"""The file format (docs/format.md): the container and its checks, sections, the
object tree, ``lcckpt.save`` / ``lcckpt.load`` and safetensors. Knows nothing of chains."""
