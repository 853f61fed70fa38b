import html
import io
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml
from rich.console import Console

from moebalance import report
from moebalance.metrics import STAT_NAMES, load_stats, rank_loads

SEED_HEADERS = ["Layer", "Routing", "Step 0 Var (Baseline)", "Step 20 Var (Run A)",
                "Step 20 Var (Run B)", "Improvement (A vs B)"]
ROW_KEYS = {"layer", "routing", "var_step0", "var_a", "var_b", "improvement", "floor", "maxvio_a",
            "maxvio_b"}
TOTAL_KEYS = {"layer", "routing", "var_step0", "var_a", "var_b", "improvement", "floor",
              "maxvio_a", "maxvio_b",
              "mean_improvement", "loss_a", "loss_b", "steps", "tokens_per_step"}


def quiet_console():
    return Console(file=io.StringIO(), width=200)


def write_run(path, step0, final, routing, *, tokens, k, steps=20, final_loss=9.0, ranks=1):
    """A fake finished run in the trainer's format: counts interpolate from step0 to final;
    ranks > 1: trained with expert parallelism (per-rank loads in the metrics)."""
    step0, final = np.asarray(step0), np.asarray(final)
    path.mkdir(parents=True)
    config = {"model_name": "fake", "num_experts": step0.shape[1], "num_experts_per_tok": k,
              "first_num_hash_layers": routing.count("hash"),
              "base_num_decoder_layers": len(routing), "steps": steps,
              "gradient_accumulation_steps": 1, "per_device_batch_size": 1,
              "max_target_length": tokens}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(steps):
            counts = step0 + (final - step0) * step / max(steps - 1, 1)
            stats = load_stats(counts)
            layers = [{"layer": i, "routing": kind,
                       **{name: float(stats[name][i]) for name in STAT_NAMES}}
                      for i, kind in enumerate(routing)]
            if ranks > 1:
                for layer, load in zip(layers, rank_loads(counts, ranks)[0]):
                    layer["rank_load"] = load.tolist()
            loss = 11.0 + (final_loss - 11.0) * step / max(steps - 1, 1)
            f.write(json.dumps({"step": step, "loss": loss, "ce": loss, "lr": 1e-3,
                                "grad_norm": 1.0, "tokens_per_s": 1e4, "layers": layers}) + "\n")
    (path / "probe_counts.json").write_text(json.dumps(
        {"tokens": tokens, "routing": list(routing),
         "counts": {"0": step0.tolist(), str(steps): final.tolist()}}))
    return path


# Hand case, E = 4, 4 tokens x K = 2 = 8 assignments (mean 2) per layer:
#   [8,0,0,0] var (36+4+4+4)/4 = 12, MaxVio 3;  [4,0,2,2] var 2, MaxVio 1;
#   [3,1,2,2] var 0.5, MaxVio 0.5.  Floor: 4 * (2/4) * (1 - 2/4) = 1.
HASH = [8, 0, 0, 0]
STEP0 = [HASH, [4, 0, 2, 2], [8, 0, 0, 0]]
FINAL_A = [HASH, [4, 0, 2, 2], [8, 0, 0, 0]]
FINAL_B = [HASH, [3, 1, 2, 2], [4, 0, 2, 2]]
ROUTING = ["hash", "topk", "topk"]


def test_seed_hash_row():
    seed_hash = [[8192] + [0] * 15]
    table = report.layer_table(seed_hash, seed_hash, seed_hash, ["hash"], 2048, 4)
    row = table["rows"][0]
    assert row["var_step0"] == row["var_a"] == row["var_b"] == 3932160.0
    assert row["improvement"] == 0.0 and row["maxvio_a"] == 15.0
    assert row["floor"] == 2048 * 0.25 * 0.75
    table["total"].update(loss_a=1.0, loss_b=1.0, steps=20, tokens_per_step=2048)
    assert "| 0 | Hash Routed | 3932160.00 | 3932160.00 | 3932160.00 | 0.00% |" in (
        report.format_markdown(table))


def test_layer_table_hand_case():
    table = report.layer_table(STEP0, FINAL_A, FINAL_B, ROUTING, num_tokens=4, k=2)
    rows = table["rows"]
    assert [r["layer"] for r in rows] == [0, 1, 2] and [r["routing"] for r in rows] == ROUTING
    assert [(r["var_step0"], r["var_a"], r["var_b"]) for r in rows] == [
        (12.0, 12.0, 12.0), (2.0, 2.0, 0.5), (12.0, 12.0, 2.0)]
    assert [r["improvement"] for r in rows] == pytest.approx([0.0, 0.75, 10 / 12])
    assert [(r["maxvio_a"], r["maxvio_b"]) for r in rows] == [(3, 3), (1, 0.5), (3, 1)]
    assert all(r["floor"] == 1.0 for r in rows)
    total = table["total"]
    # top-K only: the hash layer's 12 is in no sum
    assert (total["var_step0"], total["var_a"], total["var_b"]) == (14.0, 14.0, 2.5)
    assert total["floor"] == 2.0
    assert total["improvement"] == pytest.approx(11.5 / 14)  # ratio of sums: 82.14%
    assert total["mean_improvement"] == pytest.approx((0.75 + 10 / 12) / 2)  # 79.17%
    assert total["mean_improvement"] != pytest.approx(total["improvement"])
    assert (total["maxvio_a"], total["maxvio_b"]) == (2.0, 0.75)


def test_improvement_is_zero_for_a_balanced_run_a():
    balanced = [[2, 2, 2, 2]]
    table = report.layer_table(balanced, balanced, [[3, 1, 2, 2]], ["topk"], 4, 2)
    assert table["rows"][0]["improvement"] == 0.0 and table["total"]["improvement"] == 0.0


def ab_runs(tmp_path, final_b=FINAL_B):
    a = write_run(tmp_path / "no_balance", STEP0, FINAL_A, ROUTING, tokens=4, k=2,
                  final_loss=9.0)
    b = write_run(tmp_path / "balance", STEP0, final_b, ROUTING, tokens=4, k=2, final_loss=9.09)
    return a, b


def test_ab_report_files_and_schema(tmp_path):
    a, b = ab_runs(tmp_path)
    out = tmp_path / "report"
    console = quiet_console()
    table = report.ab_report(a, b, out, console=console)
    saved = json.loads((out / "table.json").read_text())
    assert saved == table and set(saved) == {"rows", "total"}
    assert all(set(r) == ROW_KEYS for r in saved["rows"]) and set(saved["total"]) == TOTAL_KEYS
    assert (saved["total"]["steps"], saved["total"]["tokens_per_step"]) == (20, 4)
    assert (saved["total"]["loss_a"], saved["total"]["loss_b"]) == pytest.approx((9.0, 9.09))

    markdown = (out / "table.md").read_text()
    header = markdown.splitlines()[0]
    assert [c.strip() for c in header.strip("|").split("|")] == [
        *SEED_HEADERS, "Floor", "MaxVio A", "MaxVio B"]
    assert "| TOTAL/AVG | Top-K only | 14.00 | 14.00 | 2.50 | 82.14% |" in markdown
    assert "79.17%" in markdown  # the mean of the per-layer improvements, below the table
    assert "Run A 9.0000, Run B 9.0900 (B vs A +1.00%)" in markdown

    for name in report.PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(report.PLOTS)
    assert all(src.startswith("data:") for src in re.findall(r'src="([^"]*)"', page))
    assert "<link" not in page and "<script" not in page
    assert "<th>Step 20 Var (Run A)</th>" in page and "82.14%" in page
    assert "Top-K Routed" in console.file.getvalue()  # the printed table


def test_report_page_opens_with_the_headline(tmp_path):
    """report.html: a short title; the A/B's result (improvement, MaxVio, Run B against the floor
    and the refit, the losses: table.json's numbers, hand-computed here) before any table; each
    figure says what it shows, the heatmaps on which batch."""
    a, b = ab_runs(tmp_path)
    probe = json.loads((b / "probe_counts.json").read_text())
    probe["refit"] = {"20": [HASH, [3, 1, 2, 2], [3, 1, 2, 2]]}  # top-K variances 0.5 + 0.5
    (b / "probe_counts.json").write_text(json.dumps(probe))
    report.ab_report(a, b, tmp_path / "out")
    total = json.loads((tmp_path / "out" / "table.json").read_text())["total"]
    assert (total["improvement"], total["var_b"], total["floor"], total["var_refit_b"]) == (
        pytest.approx(11.5 / 14), 2.5, 2.0, 1.0)
    page = html.unescape((tmp_path / "out" / "report.html").read_text())
    assert re.findall("<title>(.*?)</title>", page) == [
        "A/B load balancing: fake, 20 steps (no_balance vs balance)"]
    assert re.findall('<p class="headline">(.*?)</p>', page) == [
        "Improvement (A vs B): 82.14% of the summed top-K variance of the probe batch "
        "(14.00 -> 2.50).",
        "MaxVio (mean over the top-K layers): Run A 2.000, Run B 0.750.",
        "Run B's summed variance: 1.25x the sampling floor, 2.50x Run B with refitted biases.",
        "Final loss: Run A 9.0000, Run B 9.0900 (B vs A +1.00%)."]
    assert page.rindex('<p class="headline">') < page.index("<table")
    heatmaps = ("Heatmaps: the probe batch (micro-batch 0 of the held-out split's first batch, "
                "4 tokens) routed by each run after its last step")
    assert page.index("</table>") < page.index(heatmaps) < page.index('alt="heatmaps.png"')


def test_expert_parallel_runs_show_the_busiest_rank(tmp_path):
    """Runs trained with 2 expert-parallel ranks: experts (0, 1) and (2, 3). Layer 2 of Run A,
    [8, 0, 0, 0], has every assignment on rank 0: max / mean = 8 / 4 = 2."""
    table = report.layer_table(STEP0, FINAL_A, FINAL_B, ROUTING, num_tokens=4, k=2, ranks=2)
    assert [(r["rank_imbalance_a"], r["rank_imbalance_b"]) for r in table["rows"]] == [
        (2.0, 2.0), (1.0, 1.0), (2.0, 1.0)]
    assert (table["total"]["rank_imbalance_a"], table["total"]["rank_imbalance_b"]) == (1.5, 1.0)

    a = write_run(tmp_path / "a", STEP0, FINAL_A, ROUTING, tokens=4, k=2, ranks=2)
    b = write_run(tmp_path / "b", STEP0, FINAL_B, ROUTING, tokens=4, k=2, ranks=2)
    assert report.load_run(a).ranks == 2
    saved = report.ab_report(a, b, tmp_path / "ab", console=quiet_console())
    assert saved["total"]["rank_imbalance_a"] == 1.5
    markdown = (tmp_path / "ab" / "table.md").read_text()
    assert markdown.splitlines()[0].rstrip().endswith("| EP max/mean A | EP max/mean B |")
    assert "| TOTAL/AVG | Top-K only | 14.00 | 14.00 | 2.50 | 82.14% | 2.00 | 2.000 | 0.750 " \
           "| 1.500 | 1.000 |" in markdown

    plain = write_run(tmp_path / "plain", STEP0, FINAL_A, ROUTING, tokens=4, k=2)
    compared = report.compare_report([a, plain], tmp_path / "cmp", console=quiet_console())
    assert compared["total"]["rank_imbalance"] == {"a": 1.5, "plain": 1.0}
    assert "EP max/mean a" in (tmp_path / "cmp" / "table.md").read_text()
    plain_only = report.compare_report([plain], tmp_path / "cmp1", console=quiet_console())
    assert "rank_imbalance" not in plain_only["total"]


def test_ab_report_rejects_different_step0(tmp_path):
    a = write_run(tmp_path / "a", STEP0, FINAL_A, ROUTING, tokens=4, k=2)
    other = [HASH, [3, 1, 2, 2], [8, 0, 0, 0]]
    b = write_run(tmp_path / "b", other, FINAL_B, ROUTING, tokens=4, k=2)
    with pytest.raises(ValueError, match="same weights"):
        report.ab_report(a, b, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_ab_report_rejects_different_lengths(tmp_path):
    a = write_run(tmp_path / "a", STEP0, FINAL_A, ROUTING, tokens=4, k=2, steps=20)
    b = write_run(tmp_path / "b", STEP0, FINAL_B, ROUTING, tokens=4, k=2, steps=10)
    with pytest.raises(ValueError, match="same length"):
        report.ab_report(a, b, tmp_path / "out")


def test_reports_refuse_to_overwrite(tmp_path):
    a, b = ab_runs(tmp_path)
    out = tmp_path / "report"
    quiet = quiet_console()
    report.ab_report(a, b, out, console=quiet)
    with pytest.raises(FileExistsError, match="overwrite"):
        report.ab_report(a, b, out, console=quiet)
    with pytest.raises(FileExistsError):
        report.compare_report([a, b], out, console=quiet)
    report.ab_report(a, b, out, console=quiet, overwrite=True)


def test_load_run_checks_the_probe(tmp_path):
    run = write_run(tmp_path / "run", STEP0, FINAL_A, ROUTING, tokens=4, k=2)
    loaded = report.load_run(run)
    assert loaded.name == "run" and loaded.final_step == 20 and loaded.tokens == 4
    assert loaded.step0.dtype == np.int64 and loaded.step0.shape == (3, 4)
    assert loaded.routing == tuple(ROUTING) and len(loaded.metrics) == 20
    probe = json.loads((run / "probe_counts.json").read_text())
    probe["tokens"] = 5
    (run / "probe_counts.json").write_text(json.dumps(probe))
    with pytest.raises(ValueError, match="tokens \\* K"):
        report.load_run(run)
    (run / "probe_counts.json").unlink()
    with pytest.raises(FileNotFoundError, match="probe_counts.json"):
        report.load_run(run)


def test_reading_runs_does_not_import_matplotlib():
    """matplotlib is imported only where the figures are drawn (moebalance.report.plots)."""
    code = "import sys, moebalance.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compare_report_three_runs(tmp_path):
    final_c = [HASH, [2, 2, 2, 2], [3, 1, 2, 2]]
    paths = [write_run(tmp_path / "sign", STEP0, FINAL_B, ROUTING, tokens=4, k=2),
             write_run(tmp_path / "proportional", STEP0, final_c, ROUTING, tokens=4, k=2),
             write_run(tmp_path / "aux_loss", STEP0, FINAL_A, ROUTING, tokens=4, k=2,
                       steps=10)]
    out = tmp_path / "cmp"
    table = report.compare_report(paths, out, console=quiet_console())
    assert json.loads((out / "table.json").read_text()) == table
    assert set(table) == {"runs", "same_probe", "rows", "total"}
    assert table["runs"] == ["sign", "proportional", "aux_loss"] and table["same_probe"]
    assert table["rows"][2]["var"] == {"sign": 2.0, "proportional": 0.5, "aux_loss": 12.0}
    assert table["rows"][2]["maxvio"] == {"sign": 1.0, "proportional": 0.5, "aux_loss": 3.0}
    assert table["total"]["var"] == {"sign": 2.5, "proportional": 0.5, "aux_loss": 14.0}
    assert table["total"]["var_step0"]["sign"] == 14.0 and table["total"]["floor"] == 2.0
    assert table["total"]["steps"] == {"sign": 20, "proportional": 20, "aux_loss": 10}
    header = (out / "table.md").read_text().splitlines()[0]
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "Layer", "Routing", "Step 0 Var", "Var sign", "MaxVio sign", "Var proportional",
        "MaxVio proportional", "Var aux_loss", "MaxVio aux_loss", "Floor"]
    for name in (*report.PLOTS, "report.html"):
        assert (out / name).is_file()
    assert report.headline(table) == []  # no run is the baseline
    page = (out / "report.html").read_text()
    assert "<title>Load balancing: sign vs proportional vs aux_loss</title>" in page
    assert 'class="headline"' not in page


def test_calibrated_runs_show_the_online_bias_variance(tmp_path):
    """A run that calibrated its biases also stored the probe under the online rule's bias:
    the A/B table puts its variance beside Run B's; a comparison shows it for the runs that
    calibrated only."""
    online = [HASH, [8, 0, 0, 0], [4, 0, 2, 2]]  # variances 12 and 2, summed 14
    run_a = write_run(tmp_path / "a", STEP0, FINAL_A, ROUTING, tokens=4, k=2)
    run_b = write_run(tmp_path / "b", STEP0, FINAL_B, ROUTING, tokens=4, k=2)
    probe = json.loads((run_b / "probe_counts.json").read_text())
    probe["online"] = {"20": online}
    (run_b / "probe_counts.json").write_text(json.dumps(probe))
    np.testing.assert_array_equal(report.load_run(run_b).online, online)
    table = report.ab_report(run_a, run_b, tmp_path / "ab", console=quiet_console())
    assert [r["var_online_b"] for r in table["rows"]] == [12.0, 12.0, 2.0]
    assert table["total"]["var_online_b"] == 14.0 and table["total"]["var_b"] == 2.5
    markdown = (tmp_path / "ab" / "table.md").read_text()
    assert "| Online Var (Run B) |" in markdown and "Online Var: " in markdown
    assert "| TOTAL/AVG | Top-K only | 14.00 | 14.00 | 2.50 | 82.14% | 2.00 | 14.00 |" in markdown
    table = report.compare_report([run_a, run_b], tmp_path / "cmp", console=quiet_console())
    assert table["total"]["var_online"] == {"b": 14.0}  # run a did not calibrate: no column
    assert table["total"]["var"] == {"a": 14.0, "b": 2.5}
    header = (tmp_path / "cmp" / "table.md").read_text().splitlines()[0]
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "Layer", "Routing", "Step 0 Var", "Var a", "MaxVio a", "Var b", "Online Var b",
        "MaxVio b", "Floor"]
    # the online bias's counts must be counts of the probe
    probe["online"] = {"20": [HASH, [8, 0, 0, 0], [4, 0, 2, 1]]}
    (run_b / "probe_counts.json").write_text(json.dumps(probe))
    with pytest.raises(ValueError, match="online-bias step 20.*tokens \\* K"):
        report.load_run(run_b)


def test_compare_report_with_different_probes_shows_each_step0(tmp_path):
    paths = [write_run(tmp_path / "x", STEP0, FINAL_A, ROUTING, tokens=4, k=2),
             write_run(tmp_path / "y", FINAL_B, FINAL_B, ROUTING, tokens=4, k=2)]
    table = report.compare_report(paths, tmp_path / "cmp",
                                  console=quiet_console())
    assert not table["same_probe"]
    assert table["rows"][1]["var_step0"] == {"x": 2.0, "y": 0.5}
    markdown = (tmp_path / "cmp" / "table.md").read_text()
    assert "Step 0 Var x" in markdown and "Step 0 Var y" in markdown
    assert "different probe batches" in markdown


def test_write_html_escapes_text(tmp_path):
    table = report.layer_table(STEP0, FINAL_A, FINAL_B, ROUTING, num_tokens=4, k=2)
    table["total"].update(loss_a=9.0, loss_b=9.0, steps=20, tokens_per_step=4)
    configs = {"A: <b>": {"note": "</pre><script>x</script>", "steps": 20},
               "B: plain": {"note": "same", "steps": 20}}
    page = report.write_html(tmp_path, table, [], configs).read_text()
    assert "<script>" not in page and "&lt;/pre&gt;&lt;script&gt;" in page
    assert "A: &lt;b&gt;" in page
    assert "Settings that differ" in page and "<td>note</td>" in page
    assert "<td>steps</td>" not in page  # equal in both runs


def test_column_groups_hand_case():
    # label columns of 5 and 8 chars take 1 + 8 + 11 = 20 of 46; then 10 + 3 twice (46), and the
    # third 10 + 3 and the 2 + 3 in a second part (38)
    assert report.column_groups([5, 8, 10, 10, 10, 2], 2, 46) == [[0, 1, 2, 3], [0, 1, 4, 5]]
    assert report.column_groups([5, 8, 10], 2, 40) == [[0, 1, 2]]
    # a column wider than the room still gets a part of its own (never dropped)
    assert report.column_groups([5, 8, 30, 1], 2, 40) == [[0, 1, 2], [0, 1, 3]]


@pytest.mark.parametrize("width", [60, 80, 200])
def test_printed_ab_table_is_whole_at_any_width(tmp_path, width):
    """Every cell and header word of the big A/B table (with EP and refit columns and 5-digit
    variances) appears uncut in the printed output, whose lines fit the width."""
    big = np.array([[80000, 0, 0, 0], [40000, 0, 20000, 20000], [80000, 0, 0, 0]])
    a = write_run(tmp_path / "a", big, big, ROUTING, tokens=40000, k=2, ranks=2)
    b = write_run(tmp_path / "b", big, big // 2 + 10000, ROUTING, tokens=40000, k=2, ranks=2)
    console = Console(file=io.StringIO(), width=width)
    table = report.ab_report(a, b, tmp_path / "out", console=console)
    printed = console.file.getvalue()
    assert "…" not in printed
    assert max(len(line) for line in printed.splitlines()) <= width
    headers, rows, _ = report.table_cells(table)
    tokens = set(re.findall(r"\S+", printed))
    for cell in [c for row in rows for c in row] + [w for h in headers for w in h.split()]:
        assert all(word in tokens for word in cell.split()), cell
    parts = printed.count("Expert load per layer")
    assert (parts > 1) == (width < 200)


# Probe-set hand case (same E, K and tokens): per micro-batch the top-K layers' variances sum to
#   batch 0: [4,0,2,2] 2 + [3,1,2,2] 0.5 = 2.5;  batch 1: [8,0,0,0] 12 + [4,0,2,2] 2 = 14
# mean 8.25, std 5.75, min 2.5, max 14; floor 1 per layer, 2 summed.
SET_B = [FINAL_B, [HASH, [8, 0, 0, 0], [4, 0, 2, 2]]]


def test_set_table_hand_case():
    table = report.set_table({"b": np.asarray(SET_B), "refit_b": None}, ROUTING, 4, 2)
    assert table == {"batches": 2, "tokens": 4, "floor": 2.0,
                     "var": {"b": {"mean": 8.25, "std": 5.75, "min": 2.5, "max": 14.0}}}


def test_ab_report_shows_the_probe_set_beside_the_seed_table(tmp_path):
    """Runs that measured a probe set get its table below the seed's, whose numbers stay those
    of the probe (the set's first micro-batch); a set whose counts do not fit is refused."""
    runs = {}
    for name, final, sets in (("a", FINAL_A, [FINAL_A, STEP0]), ("b", FINAL_B, SET_B)):
        runs[name] = write_run(tmp_path / name, STEP0, final, ROUTING, tokens=4, k=2)
        probe = json.loads((runs[name] / "probe_counts.json").read_text())
        probe["set"] = {"counts": {"0": [STEP0, STEP0], "20": sets}}
        (runs[name] / "probe_counts.json").write_text(json.dumps(probe))
    plain = report.layer_table(STEP0, FINAL_A, FINAL_B, ROUTING, 4, 2)
    table = report.ab_report(runs["a"], runs["b"], tmp_path / "out")
    assert table["rows"] == plain["rows"]
    assert table["set"]["var"]["b"] == {"mean": 8.25, "std": 5.75, "min": 2.5, "max": 14.0}
    # Run A: batch 0 [4,0,2,2] 2 + [8,0,0,0] 12 = 14, batch 1 the same (STEP0 == FINAL_A)
    assert table["set"]["var"]["a"] == {"mean": 14.0, "std": 0.0, "min": 14.0, "max": 14.0}
    markdown = (tmp_path / "out" / "table.md").read_text()
    assert "| Run B | 8.25 | 5.75 | 2.50 | 14.00 | 4.12 |" in markdown
    assert "Improvement (A vs B) of the means: 41.07%" in markdown  # (14 - 8.25) / 14
    assert report.headline(table)[0].endswith("; 41.07% over the 2 micro-batches of the probe set.")
    assert "Run B | 8.25" in (tmp_path / "out" / "report.html").read_text().replace(
        "</td><td>", " | ").replace("<td>", "")
    probe = json.loads((runs["b"] / "probe_counts.json").read_text())
    probe["set"]["counts"]["20"] = [[HASH, [8, 0, 0, 0], [4, 0, 2, 1]]] * 2
    (runs["b"] / "probe_counts.json").write_text(json.dumps(probe))
    with pytest.raises(ValueError, match="probe set's final .*tokens \\* K"):
        report.load_run(runs["b"])


def test_report_reads_an_experiment_directory_as_its_runs(tmp_path, capsys):
    """`moebalance report DIR` on the folder `ab` wrote compares its run_a and run_b (named
    after the experiment, so two experiments' runs stay apart), as if they were given."""
    from moebalance import cli

    for exp, final_b in (("ab", FINAL_B), ("ab2", FINAL_A)):
        write_run(tmp_path / exp / "run_a", STEP0, FINAL_A, ROUTING, tokens=4, k=2)
        write_run(tmp_path / exp / "run_b", STEP0, final_b, ROUTING, tokens=4, k=2)
        (tmp_path / exp / "table.md").write_text("the experiment's own report")
    table = report.compare_report([tmp_path / "ab", tmp_path / "ab2" / "run_b"],
                                  tmp_path / "cmp", console=quiet_console())
    assert table["runs"] == ["ab/run_a", "ab/run_b", "run_b"]
    assert table["total"]["var"] == {"ab/run_a": 14.0, "ab/run_b": 2.5, "run_b": 14.0}
    assert cli.main(["report", str(tmp_path / "ab"), str(tmp_path / "ab2"), "--out",
                     str(tmp_path / "both"), "-q"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "both" / "table.json").read_text())["runs"] == [
        "ab/run_a", "ab/run_b", "ab2/run_a", "ab2/run_b"]
