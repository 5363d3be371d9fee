"""peagle_core: the P-EAGLE drafter, objectives, partitioning and vLLM checkpoint contract (pure PyTorch).

Modules, lower layers first (each imports only modules above it in this list; checked by
``tests/unit/test_layering.py``):

* ``atomic``: crash-safe replacement of files and directories (temporary sibling, fsync, rename);
* ``samples``: the captured-sample contract (keys, dtypes, validation, checksums);
  ``storage``: bytes per captured token; ``shards``: shards, manifest, capture metadata on disk;
  ``vocab``: token counts and the draft vocabulary (``d2t`` / ``t2d``);
* ``drafter_config``, ``drafter_cache``, ``drafter``: the head's architecture, its KV cache, the model;
* ``batch``: packed sequences; ``elements``: drafter slots and COD sampling; ``masks``: the
  attention rule between slots; ``partition``: Algorithm 1's segments;
* ``loss`` (+ ``kernels``): the distillation loss; ``fsdp``: FSDP2 sharding of a head;
* ``objectives``: the ``Objective`` interface and registry (``base``), P-EAGLE (``peagle``),
  EAGLE-3 TTT (``eagle3``);
* ``target``: the target's forward with aux hidden states; ``decoder``: the reference
  speculative decoder; ``contract``: export and validation of a head in vLLM's format;
  ``warm_start``: a head's architecture check and weight copy into a drafter it initializes.
"""
