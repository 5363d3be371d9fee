"""bench.report_depths: the loss share of depth 0 and the reading of the ablations of one machine and day."""

import pytest

from bench import report_depths as rd


def _run(tag: str, run: int = 1, *, overrides=(), counts=(100.0, 50.0, 50.0), device="NVIDIA H200",
         date="2026-11-26") -> dict:
    final = {f"count_d{d}": c for d, c in enumerate(counts)}
    return {"tag": tag, "run": run, "method": "peagle", "size": rd.SIZE, "train_s_goal": rd.TRAIN_S, "done": True,
            "overrides": list(overrides), "device": device, "date": date, "calls": [{"final": final}]}


def test_depth0_share_weighs_each_depth_by_the_runs_decay():
    assert rd.depth0_share(_run("uniform")) == pytest.approx(100 / 200)
    decayed = _run("decay", overrides=["training.depth_decay=0.5"])
    assert rd.depth0_share(decayed) == pytest.approx(100 / (100 + 25 + 12.5))
    assert rd.depth0_share({"calls": [{"final": {"step": 1}}]}) is None  # no per-depth counts logged


def _eval(al: float, pos: list[float]) -> dict:
    return {"acceptance_length": al, "al_per_pos": pos}


def test_reading_compares_variants_with_the_base_runs_of_the_same_machine_and_day(monkeypatch):
    runs = [_run("peagle-29k-180s", 1, device="NVIDIA H100", date="2026-11-24"),
            _run("peagle-29k-180s", 3), _run("peagle-29k-cod003-180s", counts=(100.0, 5.0, 5.0),
                                             overrides=["training.cod_ratio=0.03"]),
            _run("peagle-29k-decay05-180s", overrides=["training.depth_decay=0.5"])]
    evals = {("peagle-29k-180s", 3): _eval(1.40, [0.30, 0.08, 0.01]),
             ("peagle-29k-cod003-180s", 1): _eval(1.80, [0.60, 0.15, 0.00]),
             ("peagle-29k-decay05-180s", 1): _eval(1.35, [0.28, 0.06, 0.12])}

    def row(name, tag, run, eval_set):
        return evals.get((tag, run)) if name == rd.SCALE_EVAL and eval_set == "humaneval" else None

    monkeypatch.setattr(rd, "eval_row", row)
    text = rd.reading(runs, {})
    assert text.startswith("Reading (H200, 2026-11-26): the base recipe decodes AL 1.40 ")  # not the H100 run
    assert "cod003-180s 1.80 (position 1 0.60, depth-0 share 0.91), decay05-180s 1.35" in text
    assert "1 of the 2 variants that move the loss toward depth 0 raise position 1" in text
    assert "position 3 reaches the goal" in text and "0.12" in text  # decay05's position 3
    evals[("peagle-29k-decay05-180s", 1)] = _eval(1.50, [0.40, 0.06, 0.02])
    text = rd.reading(runs, {})
    assert "Every variant that moves the loss toward depth 0 (2) raises position 1" in text
    assert "positions >= 3 stay below the goal" in text


def test_reading_says_when_the_conditional_does_not_follow_the_depth0_share(monkeypatch):
    runs = [_run("peagle-29k-180s", 3), _run("peagle-29k-cod003-180s", counts=(100.0, 5.0, 5.0),
                                             overrides=["training.cod_ratio=0.03"])]
    monkeypatch.setattr(rd, "eval_row", lambda name, tag, run, s: _eval(1.5 if "cod" in tag else 1.4, [0.5, 0.1, 0.0])
                        if name == rd.SCALE_EVAL and s == "humaneval" else None)
    chain = {"chain_acceptance_per_pos": [0.5, 0.1, 0.01], "chain_anchors": 1000}
    tf = {"head-peagle-29k-180s-run3": chain, "head-peagle-29k-cod003-180s": chain}
    text = rd.reading(runs, tf)
    assert "given position 1: 180s-run3 0.20, cod003-180s 0.20." in text
    assert "It stays within 0.20-0.20 while the depth-0 share goes from 0.50 to 0.91" in text


def test_an_ablated_recipe_run_at_scale_is_set_beside_its_ablation_run(monkeypatch):
    small = _run("peagle-29k-cod003-180s", overrides=["training.cod_ratio=0.03"]) | {"steps": 1103, "epochs": 2.0}
    big = _run("peagle-99k-cod003-1800s", overrides=["training.cod_ratio=0.03"]) | {
        "size": 99000, "train_s_goal": 1800.0, "steps": 9150, "epochs": 3.7}
    other = _run("peagle-99k-600s") | {"size": 99000, "train_s_goal": 600.0, "steps": 1302, "epochs": 0.5}
    monkeypatch.setattr(rd, "train_rows", lambda: [small, big, other])
    monkeypatch.setattr(rd, "eval_row", lambda name, tag, run, s: None)
    tf = {"head-peagle-99k-cod003-1800s": {"chain_acceptance_per_pos": [0.8, 0.4, 0.2], "chain_anchors": 1000}}
    lines = rd.scaled_up([small, _run("peagle-29k-180s")], tf)
    assert len(lines) == 2 and "peagle-99k-600s" not in lines[0]  # no ablated recipe: left out
    assert lines[0].startswith("The recipe of peagle-29k-cod003-180s at scale: peagle-99k-cod003-1800s (99,000 "
                               "conversations, 1800 GPU-s, 9150 steps, 3.7 epochs)")
    assert "given 1..p-1: 0.50 / 0.50; against peagle-29k-cod003-180s" in lines[0]
    assert lines[0].endswith("given 1..p-1: not run.")


COD = ["training.cod_ratio=0.03", "training.cod_min_ratio=0.008"]


def test_structure_reading_sets_one_override_variants_against_the_recipes_spread_and_eagle3(monkeypatch):
    runs = [_run("peagle-29k-180s", 3), _run("peagle-29k-cod003-180s", overrides=COD) | {"steps": 1103},
            _run("peagle-29k-cod003-2l-180s", overrides=[*COD, "drafter.num_layers=2"], date="2026-11-29")
            | {"steps": 834},
            _run("peagle-29k-cod003-180s", 2, overrides=COD, date="2026-11-29") | {"steps": 785},
            _run("peagle-29k-cod003-init-180s", overrides=[*COD, "drafter.init_layers_from_target=true"],
                 date="2026-11-29") | {"steps": 1017},
            _run("peagle-29k-cod003-mm-180s", overrides=[*COD, "training.mask_hidden_init=aux_mean"],
                 date="2026-11-29") | {"steps": 833},
            _run("peagle-29k-cod003-mm-180s", 2, overrides=[*COD, "training.mask_hidden_init=aux_mean"],
                 date="2026-11-29") | {"steps": 1006}]
    eagle3 = _run("eagle3-29k-200s") | {"method": "eagle3", "train_s_goal": 200.0}
    gpu = {"peagle-29k-cod003-180s": 1.67, "peagle-29k-cod003-180s-run2": 1.54, "peagle-29k-cod003-2l-180s": 1.50,
           "peagle-29k-cod003-init-180s": 1.60, "eagle3-29k-200s": 1.40, "peagle-29k-180s-run3": 1.39,
           "peagle-29k-cod003-mm-180s": 1.49, "peagle-29k-cod003-mm-180s-run2": 1.57}
    monkeypatch.setattr(rd, "train_rows", lambda: [*runs, eagle3])
    monkeypatch.setattr(rd, "eval_row", lambda name, head, run, s: _eval(gpu[head], [0.5, 0.1, 0.0])
                        if name == rd.GPU_EVAL and s == "humaneval" and head in gpu else None)
    monkeypatch.setattr(rd, "load", lambda name: {"rows": [
        {"head": "peagle-29k-cod003-2l-180s", "eval_set": "humaneval", "concurrency": 1, "K": 7,
         "acceptance_length": 1.51, "al_per_pos": [0.5, 0.1, 0.0, 0.01, 0.0, 0.0, 0.0]}]})
    text = rd.structure_reading(runs)
    assert text.startswith("Reading, drafter structure on the recipe training.cod_ratio=0.03, "
                           "training.cod_min_ratio=0.008 (GPU vLLM HumanEval, K=5, c=1): the recipe itself 1.67 "
                           "(1,103 steps")
    assert "drafter.num_layers=2 1.50 (834 steps" in text and "drafter.init_layers_from_target=true 1.60" in text
    # the two runs of one variant are one variant, read together
    assert "training.mask_hidden_init=aux_mean 1.49 (833 steps" in text and ") and 1.57 (1,006 steps" in text
    assert "1 of the 3 variants stay within the recipe's own run-to-run spread (1.54-1.67" in text
    assert "(drafter.num_layers=2 below it; training.mask_hidden_init=aux_mean partly below it)" in text
    assert ("Against the recipe's run nearest in steps: drafter.num_layers=2 -0.04 at 834 against 785 steps; "
            "drafter.init_layers_from_target=true -0.07 at 1,017 against 1,103 steps; training.mask_hidden_init=aux_mean "
            "-0.05 at 833 against 785 steps, -0.10 at 1,006 against 1,103 steps.") in text
    assert "EAGLE-3 on the same set: eagle3-29k-200s 1.40; P-EAGLE / EAGLE-3 over these runs 1.06-1.19 at K=5" in text
    assert "at K=7 (measured for 1 of these heads) AL gains at most +0.01 over K=5" in text
    assert rd.structure_reading(runs[:2]) == ""  # no variant of an overridden recipe: nothing to read


def test_the_loss_weight_reading_keeps_the_latest_day_with_runs_of_the_recipe_itself(monkeypatch):
    runs = [_run("peagle-29k-180s", 3), _run("peagle-29k-cod003-180s", overrides=COD),
            _run("peagle-29k-cod003-180s", 2, overrides=COD, date="2026-11-29"),
            _run("peagle-29k-cod003-2l-180s", overrides=[*COD, "drafter.num_layers=2"], date="2026-11-29")]
    monkeypatch.setattr(rd, "eval_row", lambda name, tag, run, s: _eval(1.5, [0.5, 0.1, 0.0])
                        if name == rd.SCALE_EVAL and s == "humaneval" else None)
    assert rd.reading(runs, {}).startswith("Reading (H200, 2026-11-26): the base recipe decodes AL 1.50")


def test_a_recipe_at_scale_is_set_beside_the_first_run_of_its_ablation(monkeypatch):
    first = _run("peagle-29k-cod003-180s", overrides=COD) | {"steps": 1103, "epochs": 2.0}
    again = _run("peagle-29k-cod003-180s", 2, overrides=COD) | {"steps": 785, "epochs": 1.4}
    big = _run("peagle-99k-cod003-1800s", overrides=COD) | {"size": 99000, "train_s_goal": 1800.0, "steps": 9150,
                                                             "epochs": 3.7}
    monkeypatch.setattr(rd, "train_rows", lambda: [first, again, big])
    monkeypatch.setattr(rd, "eval_row", lambda name, tag, run, s: None)
    lines = rd.scaled_up([first, again], {})
    assert "against peagle-29k-cod003-180s (29,905 conversations, 180 GPU-s, 1103 steps, 2.0 epochs)" in lines[0]
