"""vLLM's ``worker_extension_cls`` for a P-EAGLE head under a K schedule with several K
(:data:`pipelines.evaluate.dynamic_k.EXTENSION`): a vLLM worker imports this module before it builds its model
runner, and the import installs :func:`pipelines.evaluate.dynamic_k.install` (the drafter's slots follow each
step's K). Imported only there: it imports vLLM.
"""

from pipelines.evaluate.dynamic_k import install

install()


class ParallelDraftingDynamicK:
    """No methods of its own (vLLM mixes it into the worker class); its module's import is the fix."""


__all__ = ["ParallelDraftingDynamicK"]
