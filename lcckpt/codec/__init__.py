"""The tensor codec: one tensor in, one blob out (docs/algorithm.md).

Quantizers (:mod:`.quantize`), entropy coding (:mod:`.entropy`), the exact codec
(:mod:`.lossless`), the blob's wire format (:mod:`.blob`), error-feedback deltas
(:mod:`.delta`), the movement sketch (:mod:`.movement`) and the Numba kernels under
them (:mod:`.kernels`). :mod:`.tensor` is its entry point (``lcckpt.encode`` /
``lcckpt.decode``). Knows nothing of files."""
