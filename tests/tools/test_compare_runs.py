"""tools/compare_runs.py: the exact table of final metrics and config differences; one-line errors."""

import pytest

from tests.tools.workdirs import A_CONFIG, A_ROWS, B_ROWS, write_a_b, write_run
from tools.compare_runs import compare, format_table, main


def test_markdown_table_of_final_metrics_and_config_differences(tmp_path):
  # a: newest step 4 row wins, torn line skipped; medians over a's steps 3, 4 (before the crash), 5 and b's 3, 5
  header, rows = compare(write_a_b(str(tmp_path)))
  assert format_table(header, rows, "md").splitlines() == [
      "| run | step | loss | loss_gap | best_eval_loss | eval_loss | eval_gap | tokens_per_sec | mfu | model.n_layers "
      "| model.scan_layers | optim.lr | train.steps | data.path | model.n_experts |",
      "| --- |" + " ---: |" * 14,
      '| a | 6 | 2.8000 | 0.8000 | 3.1000 | 3.1000 | 0.6000 | 1,100 | 11.00% | 2 | true | 0.01 | 6 | "" | - |',
      "| b | 5 | 3.7500 | - | 3.9000 | 4.2000 | - | 700 | 7.00% | 4 | false | 0.003 | 5 | x | 0 |",
  ]


def test_text_table_is_aligned(tmp_path, capsys):
  assert main([*write_a_b(str(tmp_path)), "--keys", "step,loss_gap,grad_norm"]) == 0
  assert capsys.readouterr().out.splitlines() == [
      "run  step  loss_gap  grad_norm  "
      "model.n_layers  model.scan_layers  optim.lr  train.steps  data.path  model.n_experts",
      "---  ----  --------  ---------"
      "  --------------  -----------------  --------  -----------  ---------  ---------------",
      'a       6    0.8000        0.6'
      '               2               true      0.01            6         ""                -',
      "b       5         -      0.125"
      "               4              false     0.003            5          x                0",
  ]


def test_only_differing_keys_and_runs_without_a_config(tmp_path):
  same = [write_run(str(tmp_path), name, A_ROWS, A_CONFIG) for name in ("a1", "a2")]
  assert compare(same, ["loss"]) == (["run", "loss"], [["a1", "2.8000"], ["a2", "2.8000"]])
  bare = write_run(str(tmp_path), "bare", B_ROWS)  # no config.json: its config cells are "-"
  other = dict(A_CONFIG, optim={"lr": 0.5, "schedule": "cosine"})
  header, rows = compare([*same, write_run(str(tmp_path), "a3", A_ROWS, other), bare], ["step"])
  assert header == ["run", "step", "optim.lr"]
  assert rows == [["a1", "6", "0.01"], ["a2", "6", "0.01"], ["a3", "6", "0.5"], ["bare", "5", "-"]]


BAD = {
    "unknown key": (["{tmp}/a", "--keys", "loss,los"], "compare_runs.py: --keys: no run logged 'los' (columns: step, "
                    "loss, loss_gap, best_eval_loss, eval_loss, eval_gap, tokens_per_sec, mfu, or any logged metric)"),
    "empty keys": (["{tmp}/a", "--keys", ","], "compare_runs.py: --keys: give at least one column"),
    "missing workdir": (["{tmp}/a", "{tmp}/nope"], "compare_runs.py: {tmp}/nope: no such directory"),
    "bad format": (["{tmp}/a", "--format", "csv"],
                   "compare_runs.py: argument --format: invalid choice: 'csv' (choose from 'text', 'md')"),
    "bad config.json": (["{tmp}/broken"], "compare_runs.py: {tmp}/broken/config.json: not valid JSON "
                        "(Expecting value: line 1 column 1 (char 0))"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, name):
  write_run(str(tmp_path), "a", A_ROWS, A_CONFIG)
  (tmp_path / "broken").mkdir()
  (tmp_path / "broken" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
  (tmp_path / "broken" / "config.json").write_text("")
  argv, message = BAD[name]
  with pytest.raises(SystemExit) as exit_:
    main([a.format(tmp=tmp_path) for a in argv])
  assert exit_.value.code == 2
  captured = capsys.readouterr()
  assert (captured.out, captured.err) == ("", message.format(tmp=tmp_path) + "\n")
