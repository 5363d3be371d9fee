"""The data stage (``regenerate``): prompt sources to conversations the target answered itself.

* ``prompts.py``: prompt sources (ShareGPT, HumanEval, MT-Bench, user files) normalized to chat rows;
  ``rows.py``: the row format and its checks; ``traffic_source.py``: the Serve traffic log as a source;
  ``jsonl.py``: user files as JSONL; ``selfinstruct.py``: prompts the target writes.
* ``prompt_dataset.py``: the weighted mix of a recipe's sources.
* ``engines.py``: generation engines (vLLM, Ray Data LLM, transformers); ``regenerate.py``: the work.
* Wired into the pipeline by :class:`pipelines.stages.regenerate.RegenerateStage`.

Nothing is imported here: import each module by its own name.
"""
