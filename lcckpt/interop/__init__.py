"""Reading what is already on disk: lazy reads of files and chain steps
(:mod:`.reader`, ``lcckpt.open``) and conversion from torch and safetensors files."""
