"""VLA's Triton kernels: the precision scan token by token (``token``), split in time (``split``) or chunk-parallel
(``chunk``, on the block algebra of ``_blocks``), and the fused per-token features and normaliser (``features``).

Imports no module: the ops import each one when its kernel runs (importing defines the kernels)."""
