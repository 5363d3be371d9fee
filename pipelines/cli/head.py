"""``peagle head upgrade DIR``: bring a head directory exported by an older peagle (or imported) up to today's
contract, so it loads in every vLLM release of ``peagle_core.contract.VLLM_RANGE``.

It adds the mask-token keys an export writes today (``mask_token_id`` and ``ptd_token_id``, same value) that
the head's ``config.json`` lacks, rewrites ``peagle_checksums.json`` and validates the head for every release.
Weights are not touched. The head's digest changes: a registered head upgraded this way is registered again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipelines.cli.common import CommandError, fail_cleanly
from pipelines.console import console

head_app = typer.Typer(help="Head directories (vLLM checkpoint contract).", no_args_is_help=True)


@head_app.command("upgrade")
@fail_cleanly
def upgrade_cmd(
    head_dir: Annotated[Path, typer.Argument(help="Head directory (config.json, model.safetensors).",
                                             file_okay=False)],
) -> None:
    """Add the config.json keys today's vLLM releases read (e.g. ptd_token_id for vLLM 0.26) to an older head."""
    from peagle_core.contract import VLLM_SPEC, HeadContractError, upgrade_head

    try:
        added = upgrade_head(head_dir)
    except HeadContractError as e:
        raise CommandError(str(e)) from None
    what = f"added {added}" if added else "nothing to add"
    console.print(f"{head_dir}: {what}; valid for vllm{VLLM_SPEC}", soft_wrap=True, highlight=False, markup=False)
