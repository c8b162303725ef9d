"""A small ladder end to end on the built-in model: its figures must agree with each other."""

from __future__ import annotations

import csv
import json

import pytest

from lsparse.bench.rungs import LADDER
from lsparse.image.compile import CompileOptions, compile_image
from tests.conftest import lsparse, shared_file

# one ladder of every rung on the built-in model, about a minute and a half: in the slow set (CI runs it)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    text = shared_file("tinystories/validation_100.txt")
    options = CompileOptions(calib=shared_file("tinystories/validation_100.txt"), calib_tokens=2048, window=256,
                             predictor="svd", rank=16, hot_fraction=0.1, bits=4)
    compile_image("builtin:tinystories-reglu", str(root / "image"), options)
    done = lsparse("bench", str(root / "image"), "--text", str(text), "--prompts", "1", "--prompt-tokens", "32",
                   "--gen-tokens", "32", "--quality-tokens", "256", "--budgets", "0.9", "--cache-bias", "1,4",
                   "--flock", "0.9", "--max-quality-loss", "0.3", "--kv-top-k", "16", "--kv-ram-tokens", "8", "--json",
                   "--csv", str(root / "ladder.csv"), "--plot", str(root / "ladder.png"), timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    result["by_rung"] = {row["rung"]: row for row in result["rows"]}
    result["root"] = root
    return result


def ppl(row):
    return next(iter(row["perplexity"].values()))


def test_every_rung_ran_and_wrote_csv_and_plot(ladder):
    added = ["+cache-aware 1", "+cache-aware 4", "+flock core 0.9", "+gated 30.0%", "+sparq 16", "+sparq flash 8"]
    assert list(ladder["by_rung"]) == [r.name for r in LADDER] + added
    with open(ladder["root"] / "ladder.csv", newline="") as f:
        ran = [row for row in ladder["sweep"] if "refused" not in row]
        assert len(list(csv.DictReader(f))) == len(LADDER) + len(added) + len(ran)
    assert (ladder["root"] / "ladder.png").stat().st_size > 0


def test_exact_and_hybrid_change_nothing(ladder):
    r = ladder["by_rung"]
    assert ppl(r["exact 4-bit"]) == pytest.approx(ppl(r["dense 4-bit"]), rel=1e-5)
    assert r["exact 4-bit"]["greedy_agreement"] == 1.0
    assert ppl(r["hybrid"]) == pytest.approx(ppl(r["dense fp16"]), rel=1e-5)
    assert r["hybrid"]["greedy_agreement"] == 1.0


def test_bytes_fall_down_the_ladder(ladder):
    r = ladder["by_rung"]
    assert r["naive"]["bytes_per_token"] > r["hybrid"]["bytes_per_token"] > 0
    # a larger window never reads more; bundles turn several requests into one
    assert r["+window"]["bytes_per_token"] <= r["+predictor"]["bytes_per_token"]
    assert r["+bundles+layout"]["reads_per_token"] < r["+window"]["reads_per_token"]
    assert r["+4-bit"]["bytes_needed_per_token"] < r["+hot"]["bytes_needed_per_token"]
    for row in ladder["rows"]:
        if row["mode"] not in ("dense",):
            assert row["bytes_per_token"] >= row["bytes_needed_per_token"] >= 0
            # only a strong cache bias or the flock (all of it read with the prompt) may leave a token nothing
            assert row["bytes_needed_per_token"] > 0 or row["rung"] in ("+cache-aware 4", "+flock", "+flock core",
                                                                         "+flock core 0.9")


def test_budget_sweep_stays_within_its_plan(ladder):
    for row in ladder["sweep"]:
        assert "refused" in row or row["planned_ram_bytes"] <= row["budget_bytes"]


def test_sweep_runs_at_the_plans_smallest_budget_and_refuses_below_it(ladder):
    floor = [row for row in ladder["sweep"] if "smallest budget" in row["rung"]]
    assert len(floor) == 1 and "refused" not in floor[0], floor
    assert floor[0]["tokens_per_second"] > 0
    below = [row for row in ladder["sweep"] if row["budget_bytes"] < floor[0]["budget_bytes"]]
    assert below, "the test's 90% of a tiny model is below the process's own RAM"
    for row in below:
        assert "the smallest that works is" in row["refused"]


def test_the_layout_rung_reads_the_same_neurons_in_another_order(ladder):
    """+bundles and +bundles+layout differ only in where bundles lie in the file: on the same held-out prompts
    they need the same bytes, so their reads compare the layouts alone (the gain out of sample)."""
    r = ladder["by_rung"]
    assert r["+bundles"]["bytes_needed_per_token"] == r["+bundles+layout"]["bytes_needed_per_token"] > 0
    assert r["+bundles"]["reads_per_token"] < r["+window"]["reads_per_token"]  # bundles alone batch the reads


def test_correction_gives_the_dense_paths_text(ladder):
    """+correction's text is dense 4-bit's, each round's drafts checked by the dense path."""
    r = ladder["by_rung"]["+correction"]
    assert r["greedy_agreement"] == 1.0 and 0 <= r["corrected_share"] < 1 and r["tokens_per_dense_pass"] >= 1
    assert r["perplexity"] == {}


def test_the_wanda_rung_holds_as_much_as_the_frequency_one(ladder):
    """+wanda hot pins as many neurons as +4-bit, chosen by Wanda's score: the same RAM, other neurons."""
    r = ladder["by_rung"]
    assert r["+wanda hot"]["planned_ram_bytes"] == r["+4-bit"]["planned_ram_bytes"]
    assert r["+wanda hot"]["bytes_needed_per_token"] != r["+4-bit"]["bytes_needed_per_token"]


def test_cache_aware_rungs_need_fewer_bytes_at_a_cost_in_quality(ladder):
    """--cache-bias adds DIP's rungs: the larger the bias, the fewer bytes needed from flash; each measures its
    own perplexity (its masks change the arithmetic)."""
    r = ladder["by_rung"]
    assert r["+cache-aware 4"]["bytes_needed_per_token"] < r["+4-bit"]["bytes_needed_per_token"]
    assert r["+cache-aware 4"]["bytes_needed_per_token"] <= r["+cache-aware 1"]["bytes_needed_per_token"]
    assert ppl(r["+cache-aware 4"]) != ppl(r["+4-bit"])


def test_the_flock_rungs_read_with_the_prompt_only_and_exact_flocking_is_lossless(ladder):
    """+flock and +flock core read each layer once, with the prompt, and nothing after; exact+flock is exact 4-bit's
    text and second-half perplexity (its prompt half computed with every neuron, as exact mode's is lossless)."""
    r = ladder["by_rung"]
    for name in ("+flock", "+flock core"):
        assert r[name]["bytes_per_token"] == 0 and r[name]["prompt_bytes"] > 0
    exact, flocked = r["exact 4-bit"], r["exact+flock"]
    assert flocked["greedy_agreement"] == 1.0 and 0 < flocked["bytes_per_token"]
    assert flocked["prompt_bytes"] < exact["prompt_bytes"]  # one stream, not the prompt's tokens one by one
    for text, value in exact["perplexity"].items():
        assert flocked["perplexity"][text] == pytest.approx(value, rel=1e-5), text
    assert any(text.endswith("(2nd half)") for text in exact["perplexity"])


def test_the_gated_rung_runs_an_image_compiled_for_its_bound(ladder):
    """--max-quality-loss 0.3 adds +gated 30.0%: predicted mode on a variant whose thresholds compile chose for
    that bound (tests/test_gate.py checks the bound itself); a knob of its own, so a perplexity of its own."""
    from lsparse.image.image import Image
    r = ladder["by_rung"]["+gated 30.0%"]
    assert r["bytes_needed_per_token"] > 0 and ppl(r) != ppl(ladder["by_rung"]["+4-bit"])
    variant = Image.open(ladder["root"] / "image.variants" / "4bit-gated-0.3").manifest
    assert variant.option("max_quality_loss") == 0.3 and variant.layers[0].figures["quality_gate"]["bound"] == 0.3


def test_the_sparq_rungs_read_part_of_the_attention_cache(ladder):
    """+sparq 16 reads 16 keys and values a step (and a quarter of each key's components to rank them) of up to
    64: fewer attention bytes than full attention, the same FFN reads' kind as +4-bit, a perplexity of its own.
    +sparq (64 keys) never has more than 64 keys to choose from in generation: it reads no attention bytes."""
    r = ladder["by_rung"]
    sparq = r["+sparq 16"]
    assert 0 < sparq["attention_bytes_per_token"] < sparq["attention_full_bytes_per_token"]
    assert ppl(sparq) != ppl(r["+4-bit"]) and r["+4-bit"]["attention_bytes_per_token"] == 0
    assert r["+sparq"]["attention_bytes_per_token"] == 0


def test_the_paged_kv_rung_reads_from_flash_what_sparq_chooses(ladder):
    """+sparq flash 8 is +sparq 16 with all but the newest 8 to 16 tokens of each layer's KV cache on flash: the
    same choices (attention bytes and text), read from the spill file, and fewer KV bytes planned."""
    r = ladder["by_rung"]
    paged, in_ram = r["+sparq flash 8"], r["+sparq 16"]
    assert paged["attention_bytes_per_token"] == in_ram["attention_bytes_per_token"]
    assert paged["greedy_agreement"] == in_ram["greedy_agreement"]
    assert paged["kv_flash_bytes_per_token"] > 0 == in_ram["kv_flash_bytes_per_token"]


def test_the_precision_tier_rungs_hold_hot_neurons_at_8_bits(ladder):
    """+8-bit hot and exact 8-bit hot run the variant whose hot bundles are 8-bit: a larger model as stored than
    +4-bit's (the plan holds rows this small decoded, so not more RAM), and a model (exact mode) of its own."""
    from lsparse.image.image import Image
    r = ladder["by_rung"]
    assert r["+8-bit hot"]["planned_ram_bytes"] >= r["+4-bit"]["planned_ram_bytes"]
    assert ppl(r["exact 8-bit hot"]) != ppl(r["exact 4-bit"])
    variant = Image.open(ladder["root"] / "image.variants" / "4bit-hot8")
    assert (variant.manifest.bundle.bits, variant.manifest.hot_bits) == (4, 8)
    assert variant.model_bytes() > Image.open(ladder["root"] / "image").model_bytes()
