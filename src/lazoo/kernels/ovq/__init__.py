"""OVQ attention's Triton kernels: the chunks' slot assignments (``assign``, step 1), every value each dictionary slot
takes (``versions``, step 2) and the chunk attention over the dictionary versions and the chunk's own keys
(``attention``), with its decoding kernel.

Imports no module: the ops import each one when its kernel runs (importing defines the kernels)."""
