"""`moebalance study`: arms, their shared program, the summary of a run, and the whole study on
the smoke model, stopped by SIGINT and continued by the same command, bit-exactly, its
validations equal to `eval` of the checkpoints."""

import dataclasses
import json
import os
import re
import shutil
import signal

import numpy as np
import pytest

from moebalance import cli
from moebalance.config import Config
from moebalance.metrics import load_stats
from moebalance.report.study import claims
from moebalance.rundir import RunDir, RunDirError, RunStopped
from moebalance.study import ARM_KEYS, ARMS, Arm, arm_configs, arms_from, study, summarize
from moebalance.training.hooks import Hook
from moebalance.training.step import _conflicts, program_key, shared_programs
from moebalance.training.evaluate import evaluate

SMOKE = ["steps=4", "eval_period=2", "eval_batches=1", "checkpoint_period=1",
         "max_target_length=32", "per_device_batch_size=4"]


def test_arms_of_the_command_line():
    assert [a.name for a in arms_from(None)] == ["none", "aux", "loss-free"]
    mine = arms_from([["quantile"], ["mine", "routed_bias=true", "routed_bias_update_rate=0.01"]])
    assert mine == [Arm("quantile", ARMS["quantile"]),
                    Arm("mine", ("routed_bias=true", "routed_bias_update_rate=0.01"))]
    with pytest.raises(ValueError, match="no built-in arm 'sign'.*--arm sign key=value"):
        arms_from([["sign"]])
    with pytest.raises(ValueError, match="folder name"):
        arms_from([["../up", "routed_bias=true"]])
    with pytest.raises(ValueError, match="must differ"):
        arms_from([["aux"], ["aux"]])
    args = cli.build_parser().parse_args(
        ["study", "deepseek4-smoke", "steps=8", "--out", "d", "--arm", "aux", "--arm", "mine",
         "routed_bias=true"])
    assert args.overrides == ["steps=8"] and args.arm == [["aux"], ["mine", "routed_bias=true"]]


def test_every_arm_starts_from_no_balancing_and_the_default_arms_share_one_program():
    arms = arms_from([["none"], ["aux"], ["loss-free"], ["aux-seq"], ["quantile"]])
    cfgs = arm_configs("deepseek4-tiny", ["steps=50"], arms)
    none, aux, free, aux_seq, quantile = cfgs
    assert (none.routed_bias, none.load_balance_loss_weight, none.global_balance_loss_weight,
            none.routed_bias_calibration_batches, none.probe_refit_batches) == (False, 0, 0, 0, 0)
    assert (aux.global_balance_loss_weight, aux.load_balance_loss_weight, aux.routed_bias) == (
        1e-3, 0, False)
    assert (aux_seq.load_balance_loss_weight, aux_seq.global_balance_loss_weight) == (1e-3, 0)
    assert (free.routed_bias, free.routed_bias_update_rule, free.routed_bias_update_rate,
            free.load_balance_loss_weight) == (True, "sign", 1e-3, 0)
    assert all(c.eval_period == 5 for c in cfgs)  # a tenth of the steps
    programs = shared_programs(cfgs)
    # none, aux and aux-seq run on loss-free's program computing both losses; quantile's
    # bias rule is its own program
    assert programs[0] == programs[1] == programs[2] == programs[3] != programs[4]
    assert (programs[0].routed_bias_update_rule, programs[0].load_balance_loss_weight,
            programs[0].global_balance_loss_weight) == ("sign", 1e-3, 1e-3)
    assert programs[4].routed_bias_update_rule == "quantile"
    assert not any(_conflicts(c, p) for c, p in zip(cfgs, programs))
    # two rates of one rule: one program, each arm's rate passed at run time
    two = arm_configs("deepseek4-tiny", [], [Arm("a", ARMS["loss-free"]),
                                             Arm("b", ("routed_bias=true",
                                                       "routed_bias_update_rule=sign",
                                                       "routed_bias_update_rate=0.01"))])
    assert len({json.dumps(p.__dict__) for p in shared_programs(two)}) == 1


def test_an_arms_seeds_share_its_program():
    """The seed draws the initial weights and orders the data, outside the step: an arm's runs
    over several seeds compile one program, and a run may use one compiled for another seed."""
    seeds = [dataclasses.replace(cfg, seed=seed) for seed in (0, 7)
             for cfg in arm_configs("deepseek4-tiny", [], [Arm("a", ARMS["loss-free"])])]
    programs = shared_programs(seeds)
    assert programs[0] == programs[1] and not _conflicts(seeds[1], programs[0])
    assert program_key(seeds[0]) == program_key(seeds[1])
    assert program_key(seeds[0]) != program_key(dataclasses.replace(seeds[0], steps=3))


def _record(step, loss, maxvio, validation=None):
    record = {"step": step, "ce": loss, "loss": loss + 0.5, "tokens_per_s": 100.0 + step,
              "layers": [{"routing": "hash", "maxvio": 9.0}, {"routing": "topk", "maxvio": maxvio},
                         {"routing": "topk", "maxvio": 2 * maxvio}]}
    if validation is not None:
        record["validation"] = {"loss": validation, "perplexity": float(np.exp(validation)),
                                "tokens": 64, "maxvio_global": [5.0, validation / 10, 0.5]}
    return record


def test_an_arms_summary_by_hand():
    records = [_record(0, 4.0, 0.2), _record(1, 3.0, 0.4, validation=3.5),
               _record(2, 2.0, 0.1), _record(3, 1.0, 0.3), _record(4, 0.5, 0.6, validation=3.0)]
    arm = summarize(Arm("x", ("a=1",)), records)
    # the first point: steps 0-1; MaxVio_batch of a step = mean over its top-k layers (1.5 x)
    first = {"step": 2, "val_loss": 3.5, "val_ppl": pytest.approx(np.exp(3.5)),
             "maxvio_global": pytest.approx((0.35 + 0.5) / 2),
             "maxvio_batch": pytest.approx(1.5 * (0.2 + 0.4) / 2), "train_loss": 3.5}
    last = {"step": 5, "val_loss": 3.0, "val_ppl": pytest.approx(np.exp(3.0)),
            "maxvio_global": pytest.approx((0.3 + 0.5) / 2),
            "maxvio_batch": pytest.approx(1.5 * (0.1 + 0.3 + 0.6) / 3),
            "train_loss": pytest.approx(3.5 / 3)}
    assert arm["curve"] == [first, last]
    assert {k: arm[k] for k in last if k != "step"} == {k: v for k, v in last.items()
                                                        if k != "step"}
    assert arm["spread"]["val_loss"] == [3.0, 3.5]
    assert arm["spread"]["maxvio_global"] == [pytest.approx(0.4), pytest.approx(0.425)]
    assert arm["tokens_per_s"] == 102.0
    assert arm["layers"]["maxvio_global"] == [5.0, 0.3, 0.5]
    assert arm["layers"]["maxvio_batch"] == pytest.approx([9.0, 1 / 3, 2 / 3])
    assert arm["per_step"]["maxvio_batch"] == pytest.approx([0.3, 0.6, 0.15, 0.45, 0.9])
    with pytest.raises(ValueError, match="validated nowhere"):
        summarize(Arm("x", ()), records[:1])


class _Interrupt(Hook):
    """SIGINT to this process after step `step` of the arm run `arm` (the trainer then saves a
    checkpoint and stops, as when a user presses Ctrl-C)."""

    def __init__(self, step):
        self.step_at, self.armed = step, True

    def step(self, record, counts):
        if self.armed and record["step"] == self.step_at:
            self.armed = False
            os.kill(os.getpid(), signal.SIGINT)


def test_a_stopped_study_continues_bit_exactly_and_reports(tmp_path, capsys, moebalance_logger):
    arms = arms_from([["aux"], ["loss-free"]])
    whole = study("deepseek4-smoke", SMOKE, arms, tmp_path / "whole")
    with pytest.raises(RunStopped, match="run the same command again"):
        study("deepseek4-smoke", SMOKE, arms, tmp_path / "cut", hooks=[_Interrupt(1)])
    cut = json.loads((tmp_path / "cut" / "study.json").read_text())
    assert [a["finished"] for a in cut["arms"]] == [False, False]
    assert RunDir(tmp_path / "cut" / "aux").checkpointed_steps() == 2
    # the same command, again: aux resumes after step 1, loss-free runs
    command = ["study", "deepseek4-smoke", *SMOKE, "--out", str(tmp_path / "cut"),
               "--arm", "aux", "--arm", "loss-free"]
    assert cli.main(command) == 0
    assert "MaxVio_global: loss-free" in capsys.readouterr().out
    resumed = json.loads((tmp_path / "cut" / "study.json").read_text())
    for a, b in zip(whole["arms"], resumed["arms"]):
        assert {k: v for k, v in a.items() if k != "tokens_per_s"} == {
            k: v for k, v in b.items() if k != "tokens_per_s"}
    assert [r["step"] for r in RunDir(tmp_path / "cut" / "aux").metrics()] == [0, 1, 2, 3]
    assert set(resumed) >= {"config", "steps", "tokens_per_step", "arms"}
    assert resumed["tokens_per_step"] == 4 * 32 and resumed["steps"] == 4
    assert set(resumed["arms"][0]) >= {"name", "overrides", "val_loss", "val_ppl",
                                       "maxvio_global", "maxvio_batch", "tokens_per_s", "curve"}
    assert [p["step"] for p in resumed["arms"][1]["curve"]] == [2, 4]
    # the trainer's last validation is `eval` of the final checkpoint on as many batches (the
    # same weights and held-out batches, one measurement): its loss and per-layer MaxVio_global
    records = RunDir(tmp_path / "cut" / "loss-free").metrics()
    assert ["validation" in r for r in records] == [False, True, False, True]
    measured = evaluate(tmp_path / "cut" / "loss-free", batches=1)
    last = records[-1]["validation"]
    assert (last["loss"], last["tokens"]) == (measured["loss"], measured["tokens"])
    assert resumed["arms"][1]["val_loss"] == measured["loss"]
    assert resumed["arms"][1]["layers"]["maxvio_global"] == last["maxvio_global"] == [
        r["maxvio_global"] for r in measured["layers"]]
    counts = np.fromfile(tmp_path / "cut" / "loss-free" / "expert_counts.i32", np.int32)
    counts = counts.reshape(len(records), 4, 8)
    assert resumed["arms"][1]["per_step"]["maxvio_batch"] == pytest.approx(
        load_stats(counts)["maxvio"][:, 2:].mean(1))
    # finished: the same command trains nothing, also where the arm's run directory is gone
    # (study.json records it: a study moves between machines without its checkpoints)
    before = (tmp_path / "cut" / "loss-free" / "metrics.jsonl").stat().st_mtime_ns
    shutil.rmtree(tmp_path / "cut" / "aux")
    assert cli.main(command) == 0
    assert (tmp_path / "cut" / "loss-free" / "metrics.jsonl").stat().st_mtime_ns == before
    assert not (tmp_path / "cut" / "aux").exists()
    assert json.loads((tmp_path / "cut" / "study.json").read_text()) == resumed
    # another plan is refused
    with pytest.raises(RunDirError, match="holds another study.*--overwrite"):
        study("deepseek4-smoke", SMOKE, arms_from(None), tmp_path / "cut")
    # the report of a study's folder, elsewhere
    assert cli.main(["report", str(tmp_path / "cut"), "--out", str(tmp_path / "rep")]) == 0
    page = (tmp_path / "rep" / "report.html").read_text()
    assert page.count("data:image/png;base64") == 3 and "MaxVio_global: loss-free" in page
    table = (tmp_path / "rep" / "study.md").read_text()
    assert "| loss-free |" in table
    # what a validation measured, by name: the first eval_batches batches and their tokens
    assert (f"MaxVio_global: (max - mean) / mean of the expert counts over the first 1 held-out "
            f"global batch ({measured['tokens']:,} tokens, the same at every validation)"
            in table) and "all the validation tokens" not in page
    assert "on one seed's digits" in table  # one seed: no margin to weigh the difference
    # a report is never replaced silently, but for the study's own, rebuilt in its folder
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "cut"), "--out", str(tmp_path / "rep")]) == 2
    assert "rep already holds a report (study.md" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path / "cut"), "--out", str(tmp_path / "rep"),
                     "--overwrite"]) == 0
    assert cli.main(["report", str(tmp_path / "cut"), "--out", str(tmp_path / "cut")]) == 0


def test_an_arm_varies_its_balancing_alone():
    # the built-in arms are balancing recipes, and ARM_KEYS names keys of the schema
    fields = {f.name for f in dataclasses.fields(Config)}
    assert set(ARM_KEYS) <= fields
    assert all(o.split("=")[0] in ARM_KEYS for overrides in ARMS.values() for o in overrides)
    arms_from([["a", *(f"{key}=1" for key in ARM_KEYS)]])  # every balancing key is taken
    with pytest.raises(ValueError, match="arm 'b' may not set seed: .*--seeds S1 S2"):
        arms_from([["aux"], ["b", "routed_bias=true", "seed=7"]])
    # every other key of the schema is refused: the model, the data, the steps, the evaluation
    for key in sorted(fields - set(ARM_KEYS) - {"seed"}):
        with pytest.raises(ValueError, match=f"arm 'b' may not set {key}: it is not a "
                                             "balancing key.*before the first --arm"):
            arms_from([["aux"], ["b", f"{key}=3"]])
    with pytest.raises(ValueError, match="may not set routed_bais: no such balancing key; did "
                                         "you mean routed_bias"):
        arms_from([["b", "routed_bais=true"]])
    with pytest.raises(ValueError, match="'routed_bias' is not key=value"):
        arms_from([["b", "routed_bias"]])
    # on the command line, as issue 62 tried it
    for arm in (["b", "seed=7"], ["b", "steps=3"]):
        assert cli.main(["study", "deepseek4-smoke", "--out", "unused", "--arm", "aux",
                         "--arm", *arm]) == 2
    # seeds: by --seeds alone, every arm once per seed
    args = cli.build_parser().parse_args(
        ["study", "deepseek4-smoke", "--out", "d", "--arm", "aux", "--seeds", "3", "5"])
    assert args.seeds == [3, 5] and args.arm == [["aux"]]
    cfgs = arm_configs("deepseek4-smoke", [], arms_from([["aux"], ["loss-free"]]), [3, 5])
    assert [(c.global_balance_loss_weight, c.seed) for c in cfgs] == [
        (1e-3, 3), (1e-3, 5), (0, 3), (0, 5)]
    with pytest.raises(ValueError, match="seeds by --seeds alone"):
        arm_configs("deepseek4-smoke", ["seed=1"], arms_from(None), [3, 5])
    with pytest.raises(ValueError, match="different seeds"):
        arm_configs("deepseek4-smoke", [], arms_from(None), [3, 3])


def test_a_study_continues_only_on_the_same_global_batch(tmp_path, monkeypatch):
    import jax

    import moebalance.study as study_module

    arms = arms_from([["aux"]])
    plan = study_module._plan({"config": "deepseek4-smoke", "overrides": SMOKE, "seeds": None,
                               "arms": [{"name": "aux", "overrides": list(ARMS["aux"])}]})
    cfgs = arm_configs("deepseek4-smoke", SMOKE, arms)
    started = study_module._start(tmp_path, plan, cfgs, overwrite=False)
    devices = jax.device_count()
    assert started["batch"] == {"sequences": 4 * devices, "micro_batches": 1,
                                "sequence_length": 32}
    assert started["tokens_per_step"] == 4 * devices * 32 and started["devices"] == devices
    # the same study on twice the devices: twice the rows a step, refused before any training
    monkeypatch.setattr(jax, "device_count", lambda: 2 * devices)
    refused = (f"trained on 1 micro-batch\\(es\\) of {4 * devices} x 32 tokens on {devices} "
               f"device\\(s\\); here a step would be 1 micro-batch\\(es\\) of {8 * devices} x 32 "
               f"tokens on {2 * devices} device\\(s\\).*--overwrite or another --out")
    with pytest.raises(RunDirError, match=refused):
        study("deepseek4-smoke", SMOKE, arms, tmp_path)
    # a study.json written before the batch was recorded: its tokens per step decide
    older = {k: v for k, v in started.items() if k not in ("batch", "devices", "seeds")}
    (tmp_path / "study.json").write_text(json.dumps(older))
    with pytest.raises(RunDirError, match=f"trained on {4 * devices * 32:,} tokens a step"):
        study("deepseek4-smoke", SMOKE, arms, tmp_path)
    assert not (tmp_path / "aux").exists()


def _finished(name, seed, ppl, maxvio):
    return {"name": name, "overrides": [], "seed": seed, "finished": True, "val_ppl": ppl,
            "maxvio_global": maxvio}


@pytest.mark.parametrize("free,aux,verdict", [
    # means 10.4 vs 10.2: +0.2 within the margin 0.4 (aux's range, the larger)
    ([10.3, 10.5], [10.0, 10.4], "the difference \\+0.200 against a margin of 0.400 .*no "
                                 "worse, within the spread: holds"),
    ([10.0, 10.1], [10.5, 10.6], "-0.500 against a margin of 0.100 .*lower beyond the spread: "
                                 "holds"),
    ([11.0, 11.1], [10.0, 10.2], "\\+0.950 against a margin of 0.200 .*higher beyond the "
                                 "spread: does not hold"),
    ([10.3], [10.2], "loss-free's is higher: does not hold on one seed's digits \\(no "
                     "seed-to-seed spread"),
    ([10.1], [10.2], "loss-free's is lower or equal: holds on one seed's digits"),
])
def test_the_perplexity_claim_states_its_margin(free, aux, verdict):
    runs = [*(_finished("loss-free", s, p, 0.05) for s, p in enumerate(free)),
            *(_finished("aux", s, p, 0.5) for s, p in enumerate(aux)), _finished("none", 0, 9, 1)]
    seeds = None if len(free) == 1 else list(range(len(free)))
    balance, ppl = claims({"seeds": seeds, "arms": runs})
    assert re.search(verdict, ppl), ppl
    assert balance.startswith("MaxVio_global" + ("" if seeds is None else " (means over 2 and "
                                                 "2 seeds)") + ": loss-free 0.050, aux 0.500")


def test_a_study_over_seeds_weighs_the_perplexity_against_their_spread(tmp_path):
    smoke = ["steps=1", "eval_batches=1", "probe_batches=1", "max_target_length=32",
             "per_device_batch_size=4"]
    arms = arms_from([["aux"], ["loss-free"]])
    result = study("deepseek4-smoke", smoke, arms, tmp_path, seeds=[0, 1])
    assert result["seeds"] == [0, 1]
    assert [(a["name"], a["seed"], a["finished"]) for a in result["arms"]] == [
        ("aux", 0, True), ("aux", 1, True), ("loss-free", 0, True), ("loss-free", 1, True)]
    for name in ("aux", "loss-free"):
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["seed0", "seed1"]
    # the first step's cross-entropy: one seed's weights and batch in both arms (no bias yet,
    # the aux loss outside the cross-entropy), other weights and batches at the other seed
    first = {(a["name"], a["seed"]): a["per_step"]["loss"][0] for a in result["arms"]}
    assert first["aux", 0] == first["loss-free", 0] and first["aux", 1] == first["loss-free", 1]
    assert first["aux", 0] != first["aux", 1]
    ppl = {(a["name"], a["seed"]): a["val_ppl"] for a in result["arms"]}
    margin = max(abs(ppl[n, 0] - ppl[n, 1]) for n in ("aux", "loss-free"))
    difference = (ppl["loss-free", 0] + ppl["loss-free", 1] - ppl["aux", 0] - ppl["aux", 1]) / 2
    table = (tmp_path / "study.md").read_text()
    assert f"the difference {difference:+.3f} against a margin of {margin:.3f}" in table
    assert "| aux (seed 1) |" in table and "| loss-free (seed 0) |" in table
    # the same study without its seeds is another study
    with pytest.raises(RunDirError, match="holds another study.*seeds \\[0, 1\\]"):
        study("deepseek4-smoke", smoke, arms, tmp_path)


def test_the_report_says_whether_every_run_ran_one_commit():
    from moebalance.report.study import commits

    def arm(name, commit=None):
        return {"name": name, "finished": True, **({} if commit is None else {"commit": commit})}

    one = {"seeds": None, "arms": [arm("aux", "b917d0c"), arm("loss-free", "b917d0c")]}
    assert commits(one) == "Every run at b917d0c."
    two = {"seeds": None, "arms": [arm("aux", "b917d0c"), arm("loss-free", "cd348a7"),
                                   {"name": "none", "finished": False}]}
    assert commits(two) == ("The runs ran different code, so they are not one experiment: "
                            "aux at b917d0c, loss-free at cd348a7.")
    older = {"seeds": [0, 1], "arms": [{**arm("aux"), "seed": 0}, {**arm("aux", "abc"), "seed": 1}]}
    assert "aux (seed 0) at not recorded, aux (seed 1) at abc" in commits(older)
