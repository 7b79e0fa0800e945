"""rollouts/step_N.jsonl (:mod:`i3core.loop.rollouts`): the lines the orchestrator keeps, the size cap, `i3core
rollouts`, and the wandb sink's sample table. A whole run writing them is in tests/test_end_to_end.py."""

import asyncio
import json
import time

import pytest

from i3core.loop import rollouts
from i3core.plugins.envs.reverse_text import ReverseText
from i3core.plugins.models.tiny_moe.tokenizer import build_tokenizer
from i3core.testing import ScriptedClient, make_component

from .conftest import run_cli


def scored(replies):
    """Rollouts of reverse-text's first example, one per scripted reply (text, or a function of the example),
    through the env's own rollout path."""
    env = ReverseText(ReverseText.Config(num_examples=4, max_tokens=8))
    example = env.examples()[0]
    tokenizer = build_tokenizer()
    replies = [r(example) if callable(r) else r for r in replies]
    client = ScriptedClient(tokenizer, replies, stop=[env.stop_text])  # where a run stops it: the stop text
    return env, example, tokenizer, [asyncio.run(env.rollout(client, example)) for _ in replies]


def test_a_line_holds_what_the_env_scored_and_the_tokens_trained():
    env, example, tokenizer, (right, cut) = scored([lambda e: e.answer + "\nextra", "zzzzzzzzzzzz"])
    right.advantage = 0.5
    line = rollouts.record(right, rollouts.TRAINED, "reverse-text", tokenizer)
    assert line["prompt"] == example.prompt and line["completion"] == example.answer  # the text ends before it
    assert line["reward"] == 1.0 == env.score(line["completion"], example) and line["advantage"] == 0.5
    assert line["finish_reason"] == "stop" and line["outcome"] == "trained" and line["env"] == "reverse-text"
    assert tokenizer.decode(line["completion_ids"]) == example.answer + "\n"
    assert line["loss_mask"] == [True] * len(line["completion_ids"]) and line["versions"] == [0] * len(line["loss_mask"])
    line = rollouts.record(cut, rollouts.MASKED.format(reason="nonfinite_reward"), "reverse-text", tokenizer)
    assert line["finish_reason"] == "length" and len(line["completion_ids"]) == 8
    assert line["outcome"] == "masked: nonfinite_reward"
    assert json.loads(json.dumps(line)) == line


def test_files_per_step_the_cap_drops_the_oldest_and_keep_off_writes_nothing(tmp_path):
    _, example, tokenizer, (rollout,) = scored(["abc\n"])
    line = rollouts.record(rollout, rollouts.TRAINED, "reverse-text", tokenizer)
    size = len(json.dumps(line)) + 1
    log = rollouts.RolloutLog(tmp_path, keep=True, max_bytes=int(2.5 * 3 * size))
    for step in range(1, 6):
        log.add(rollouts.unscored(example, rollouts.FAILED, "reverse-text", "boom"))
        for _ in range(2):
            log.add(line)
        written = log.write(step)
        assert [w["outcome"] for w in written] == ["trained", "trained", "failed"]  # the batch's first
    assert sorted(rollouts.step_files(tmp_path / "rollouts")) == [4, 5]
    step, lines = rollouts.read(tmp_path)
    assert step == 5 and lines[2] == {**rollouts.unscored(example, "failed", "reverse-text"), "error": "boom"}
    text = rollouts.render(step, lines)
    assert text.startswith("step 5: 3 rollouts") and "error: boom" in text and example.prompt in text
    off = rollouts.RolloutLog(tmp_path / "off", keep=False, max_bytes=1 << 20)
    off.add(line)
    assert off.write(1) == [] and not (tmp_path / "off").exists()


def test_rollouts_command_prints_a_step_and_says_what_it_cannot_in_one_line(tmp_path):
    _, _, tokenizer, (rollout,) = scored(["cba\n"])
    log = rollouts.RolloutLog(tmp_path, keep=True, max_bytes=1 << 20)
    log.add(rollouts.record(rollout, rollouts.DROPPED, "reverse-text", tokenizer))
    log.write(3)
    shown = run_cli("rollouts", str(tmp_path))
    assert shown.returncode == 0 and shown.stdout.startswith("step 3: 1 rollouts") and "dropped" in shown.stdout
    for args, words in [((str(tmp_path), "--step", "2"), "has no rollouts of step 2 (steps 3-3 are kept)"),
                        ((str(tmp_path / "nope"),), "is not a directory"),
                        ((str(tmp_path / "rollouts"),), "has no rollouts")]:
        result = run_cli("rollouts", *args)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        (error,) = result.stderr.strip().splitlines()
        assert error.startswith("error: ") and words in error


def test_wandb_sink_logs_a_sample_table_per_step(tmp_path):
    pytest.importorskip("wandb")
    from .test_observability import wandb_records

    _, _, tokenizer, (rollout,) = scored(["cba\n"])
    line = rollouts.record(rollout, rollouts.TRAINED, "reverse-text", tokenizer)
    sink = make_component("metric_sink", "wandb", project="i3core-tests", sample_rows=2)
    sink.open(tmp_path)
    for step in (1, 2):
        sink.write_rollouts(step, [line] * 3)
        sink.write(step, {"loss": 0.5})
    sink.close()
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    for _ in range(300):  # the service process may flush after finish() returns (bounded: 30 s)
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    tables = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items, table = {}, {}
            for item in record.history.item:  # a table is logged as nested keys: (name, field)
                if list(item.nested_key[:1]) == ["rollouts/samples"]:
                    table[item.nested_key[1]] = json.loads(item.value_json)
                else:
                    items[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
            if table:
                tables.append((items["_step"], table, items["loss"]))
    assert [(step, table["_type"], table["nrows"], loss) for step, table, loss in tables] == [
        (1, "table-file", 2, 0.5), (2, "table-file", 2, 0.5)]
    (table_file,) = {t["path"] for _, t, _ in tables[:1]}
    data = json.loads(next((tmp_path / "wandb").glob(f"offline-run-*/files/{table_file}")).read_text())
    assert data["columns"][:4] == ["step", "env", "outcome", "prompt"]
    assert data["data"][0][:5] == [1, "reverse-text", "trained", rollout.example.prompt, "cba"]  # the text scored


def test_rollouts_command_skips_malformed_lines_with_a_count(tmp_path):
    """Lines that are not rollouts (not JSON, not an object, token lists that are not lists) are skipped with one
    warning naming their numbers; a file with none readable is one error line."""
    _, _, tokenizer, (rollout,) = scored(["cba\n"])
    log = rollouts.RolloutLog(tmp_path, keep=True, max_bytes=1 << 20)
    for _ in range(2):
        log.add(rollouts.record(rollout, rollouts.TRAINED, "reverse-text", tokenizer))
    log.write(3)
    path = tmp_path / "rollouts" / "step_3.jsonl"
    good = path.read_text().splitlines()
    path.write_text("\n".join([good[0], "garbage", "[1, 2]", '{"versions": 5}', '{"prompt": "p"}', good[1]]) + "\n")
    shown = run_cli("rollouts", str(tmp_path))
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert shown.stdout.startswith("step 3: 3 rollouts")
    (warning,) = shown.stderr.strip().splitlines()
    assert "malformed lines skipped" in warning and "count=3" in warning and "lines=[2, 3, 4]" in warning
    path.write_text("garbage\n[1]\n")
    none = run_cli("rollouts", str(tmp_path))
    assert none.returncode == 1 and none.stderr.strip().splitlines() == [
        f"error: {path} has no readable rollout: its 2 lines are not rollout objects"]
