"""lm-evaluation-harness task YAML over local files: `dataset_path: json` with
`dataset_kwargs: {data_files: {split: path}}` (relative to the YAML, or absolute), each doc turned
into a record of jaxtrain's kind by the YAML's doc_to_text / doc_to_choice / doc_to_target, as
lm-eval's ConfigurableTask does (api/task.py): a value naming a column is that field, any other
string a Jinja2 template (lm-eval's environment: StrictUndefined, keep_trailing_newline); a
doc_to_choice template renders a Python list literal, a doc_to_target an int index into the choices
or a choice. output_type multiple_choice -> multiple_choice, loglikelihood_rolling -> perplexity
(its text is doc_to_target, as lm-eval's), generate_until -> generate. Docs come from test_split,
else validation_split; few-shot examples from fewshot_split, else training_split, else
validation_split, else the test docs, a doc dropped from its own examples only where fewshot_split
equals test_split (lm-eval's rule); `num_fewshot` is the task's own count (a caller's num_fewshot
overrides it), `description` (a field or template) goes before each doc's examples, and
`fewshot_config: {sampler: default | first_n}` picks how examples are drawn. Anything else
(!function, process_docs, a remote dataset_path, filter_list, ...) is one ConfigError line naming
the file, line and key; nothing is downloaded. Without jinja2 installed, templates may only
substitute fields ("{{question}}")."""

import ast
import os
import re

from jaxtrain import config as config_lib
from jaxtrain.eval import kinds

KIND = {"multiple_choice": "multiple_choice", "loglikelihood_rolling": "perplexity",
        "generate_until": "generate"}
METRICS = {"multiple_choice": ("acc", "acc_norm"),
           "perplexity": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
           "generate": ("exact_match",)}
SPLITS = ("test_split", "validation_split", "training_split", "fewshot_split")
# read; ignored (names, bookkeeping); accepted only at the value lm-eval would make a no-op
READ = ("dataset_path", "dataset_kwargs", "output_type", "doc_to_text", "doc_to_target",
        "doc_to_choice", "target_delimiter", "fewshot_delimiter", "generation_kwargs",
        "metric_list", "num_fewshot", "description", "fewshot_config", *SPLITS)
IGNORED = ("task", "task_alias", "tag", "group", "metadata", "dataset_name",
           "should_decontaminate", "doc_to_decontamination_query")
NO_OP = {"repeats": (1, "")}
SAMPLERS = ("default", "first_n")
GENERATION_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature")


class _Function:
  """A `!function module.name` value: kept so that the key holding it is refused by name."""

  def __init__(self, loader, node):
    del loader, node


def _read_yaml(path: str) -> tuple[dict, dict]:
  """(the YAML's top-level mapping, {key: line})."""
  import yaml

  class Loader(yaml.SafeLoader):
    pass

  Loader.add_constructor("!function", _Function)
  if not os.path.isfile(path):
    raise config_lib.ConfigError(f"{path}: no such task file")
  with open(path, encoding="utf-8") as f:
    loader = Loader(f)
    try:
      node = loader.get_single_node()
      data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
      line = e.problem_mark.line + 1 if getattr(e, "problem_mark", None) else 1
      raise kinds.error(path, line, f"not YAML ({getattr(e, 'problem', None) or e})") from None
    finally:
      loader.dispose()
  if not isinstance(data, dict):
    raise kinds.error(path, 1, "an lm-eval task YAML must be a mapping of keys")
  return data, {k.value: k.start_mark.line + 1 for k, _ in node.value}


def _function_in(value) -> bool:
  if isinstance(value, dict):
    return any(map(_function_in, value.values()))
  return isinstance(value, _Function) or (isinstance(value, list) and any(map(_function_in, value)))


def _check_keys(path: str, cfg: dict, lines: dict) -> None:
  for key, value in cfg.items():
    err = lambda what: kinds.error(path, lines.get(key, 1), f"{key!r}: {what}")
    if _function_in(value):
      raise err("!function (Python code from the task's directory) is not supported")
    if key in NO_OP and value != NO_OP[key][0]:
      raise err(f"only {NO_OP[key][0]!r} is supported, got {value!r}; {NO_OP[key][1]}")
    if key not in READ + IGNORED + tuple(NO_OP):
      raise err(f"not supported (jaxtrain reads {', '.join(READ)})")
  shots = cfg.get("num_fewshot", 0)
  if isinstance(shots, bool) or not isinstance(shots, int) or shots < 0:
    raise kinds.error(path, lines.get("num_fewshot", 1),
                      f"'num_fewshot' must be an integer >= 0, got {shots!r}")
  fewshot_cfg = cfg.get("fewshot_config") or {}
  if not isinstance(fewshot_cfg, dict) or set(fewshot_cfg) - {"sampler"} or \
      fewshot_cfg.get("sampler", "default") not in SAMPLERS:
    raise kinds.error(path, lines.get("fewshot_config", 1),
                      f"'fewshot_config': only {{sampler: {' | '.join(SAMPLERS)}}} is supported, "
                      f"got {fewshot_cfg!r}")
  if cfg.get("dataset_path") != "json":
    raise kinds.error(path, lines.get("dataset_path", 1),
                      f"'dataset_path': {cfg.get('dataset_path')!r} is not local: jaxtrain reads "
                      "only dataset_path: json with dataset_kwargs: {data_files: {split: path}}, "
                      "no downloads")
  kwargs = cfg.get("dataset_kwargs")
  if not isinstance(kwargs, dict) or set(kwargs) != {"data_files"}:
    raise kinds.error(path, lines.get("dataset_kwargs", 1),
                      "'dataset_kwargs' must be {data_files: {split: local path}} and nothing else")


def _data_files(path: str, cfg: dict, lines: dict) -> dict:
  """{split: [absolute path, ...]} of dataset_kwargs.data_files (a bare path is split "train")."""
  files = cfg["dataset_kwargs"]["data_files"]
  files = {"train": files} if isinstance(files, (str, list)) else files
  bad = not isinstance(files, dict) or not all(
      isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(x, str) for x in v))
      for v in files.values())
  if bad or any(re.match(r"^[a-z][a-z0-9+.-]*://", f) for v in files.values() for f in
                ([v] if isinstance(v, str) else v)):
    raise kinds.error(path, lines.get("dataset_kwargs", 1),
                      "'dataset_kwargs': data_files must map splits to local paths, got "
                      f"{cfg['dataset_kwargs']['data_files']!r}")
  here = os.path.dirname(os.path.abspath(path))
  return {split: [os.path.join(here, f) for f in ([v] if isinstance(v, str) else v)]
          for split, v in files.items()}


def _renderer(path: str, line: int, key: str, template: str):
  """doc -> the template rendered as lm-eval renders it (jinja2), or by field substitution."""
  try:
    import jinja2
  except ImportError:
    jinja2 = None
  if jinja2 is None:
    if re.search(r"\{[{%#]", re.sub(r"\{\{\s*\w+\s*\}\}", "", template)):
      raise kinds.error(path, line, f"{key!r}: {template!r} needs jinja2 (pip install jinja2); "
                                    "without it templates may only substitute fields")
    return lambda **doc: re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: str(doc[m.group(1)]), template)
  env = jinja2.Environment(loader=jinja2.BaseLoader, undefined=jinja2.StrictUndefined,
                           keep_trailing_newline=True)
  env.filters["regex_replace"] = lambda s, pattern, repl, count=0: re.sub(pattern, repl, s,
                                                                           count=count)
  try:
    return env.from_string(template).render
  except jinja2.TemplateError as e:
    raise kinds.error(path, line, f"{key!r}: not a Jinja2 template ({e})") from None


def _field_or_template(path: str, lines: dict, key: str, spec, features: set):
  """doc -> (value, rendered): the field `spec` names, else the template rendered."""
  if isinstance(spec, str) and spec in features:
    return lambda doc: (doc.get(spec), False)
  if isinstance(spec, str):
    render = _renderer(path, lines.get(key, 1), key, spec)
    return lambda doc: (render(**doc), True)
  if key == "doc_to_target" and isinstance(spec, int) and not isinstance(spec, bool):
    return lambda doc: (spec, False)
  if key == "doc_to_choice" and isinstance(spec, (list, dict)):
    return lambda doc: (list(spec.values()) if isinstance(spec, dict) else spec, False)
  raise kinds.error(path, lines.get(key, 1), f"{key!r}: expected a field name or a template, "
                                             f"got {spec!r}")


def _converter(path: str, cfg: dict, lines: dict, kind: str, features: set):
  """(data file, line, raw doc) -> the jaxtrain record of `kind`."""
  if kind == "multiple_choice" and "doc_to_choice" not in cfg:
    raise kinds.error(path, 1, "output_type multiple_choice needs 'doc_to_choice'")
  spec = lambda key: (_field_or_template(path, lines, key, cfg[key], features) if key in cfg
                      else None)
  text, target = spec("doc_to_text"), spec("doc_to_target")
  choices, description = spec("doc_to_choice"), spec("description")
  if target is None or (text is None and kind != "perplexity"):
    raise kinds.error(path, 1, f"output_type {cfg.get('output_type')} needs 'doc_to_target'"
                               + ("" if kind == "perplexity" else " and 'doc_to_text'"))

  def convert(data_path: str, n: int, doc) -> dict:
    where = lambda what: kinds.error(data_path, n, f"{what} (task {path})")
    if not isinstance(doc, dict):
      raise where(f"expected a JSON object, got {type(doc).__name__}")
    try:
      record = {}
      if kind != "perplexity":
        context, _ = text(doc)
        if not isinstance(context, str):
          raise where(f"doc_to_text gives {context!r}, not a string (lm-eval's multiple inputs "
                      "are not supported)")
        record["context"] = context
      if description is not None:
        record["description"] = str(description(doc)[0] or "")
      gold, rendered = target(doc)
      options = None
      if choices is not None:
        options, from_template = choices(doc)
        try:
          options = ast.literal_eval(options) if from_template else options
        except (ValueError, SyntaxError):
          raise where(f"doc_to_choice renders {options!r}, not a list literal") from None
        if not isinstance(options, list):
          raise where(f"doc_to_choice gives {options!r}, not a list")
      if rendered and isinstance(gold, str) and gold.isdigit() and options is not None:
        gold = int(gold)  # lm-eval: a rendered digit string is an index when there are choices
      elif rendered and gold[:1] == "[" and gold[-1:] == "]":
        raise where(f"doc_to_target gives a list {gold!r}: several targets are not supported")
    except config_lib.ConfigError:  # a ValueError, already one line
      raise
    except (KeyError, ValueError, SyntaxError, TypeError) as e:
      raise where(f"{type(e).__name__}: {e}") from None
    except Exception as e:  # jinja2's UndefinedError and friends, without importing jinja2
      if type(e).__module__.startswith("jinja2"):
        raise where(f"template: {e}") from None
      raise
    return _record(kind, record, gold, options, where)

  return convert


def _record(kind: str, record: dict, gold, options: list | None, where) -> dict:
  """The record of `kind` from a doc's context, target and choices (lm-eval's process_results:
  a target naming a choice is its index; a generate target that is an index is that choice)."""
  if kind == "multiple_choice":
    if isinstance(gold, str):
      if gold not in options:
        raise where(f"doc_to_target {gold!r} is not one of the choices {options}")
      gold = options.index(gold)
    return {**record, "choices": options, "gold": gold}
  if kind == "generate":
    if isinstance(gold, int) and not isinstance(gold, bool) and options is not None:
      gold = options[gold] if 0 <= gold < len(options) else None
    if not isinstance(gold, (str, int)) or isinstance(gold, bool):
      raise where(f"doc_to_target gives {gold!r}, not an answer string")
    return {**record, "answer": str(gold)}
  return {"text": gold}


def _options(path: str, cfg: dict, lines: dict, kind: str) -> dict:
  """jaxtrain's kind options from generation_kwargs (until, max_gen_toks -> max_new_tokens,
  do_sample false -> greedy, temperature), checked as a JSONL header's are; metric_list checked."""
  header, gen = {}, cfg.get("generation_kwargs") or {}
  line = lines.get("generation_kwargs", 1)
  if gen and kind != "generate":
    raise kinds.error(path, line, "'generation_kwargs' is only read for output_type generate_until")
  if not isinstance(gen, dict) or set(gen) - set(GENERATION_KWARGS):
    raise kinds.error(path, line, f"'generation_kwargs': only {GENERATION_KWARGS} are supported, "
                                  f"got {gen!r}")
  until = gen.get("until", [cfg.get("fewshot_delimiter", "\n\n")])  # lm-eval's default
  if kind == "generate":
    header["until"] = [until] if isinstance(until, str) else until
    if "max_gen_toks" in gen:
      header["max_new_tokens"] = gen["max_gen_toks"]
    if gen.get("do_sample", False):
      header["temperature"] = float(gen.get("temperature", 1.0))
  for key in ("target_delimiter", "fewshot_delimiter"):
    if not isinstance(cfg.get(key, ""), str):
      raise kinds.error(path, lines.get(key, 1), f"{key!r} must be a string")
  opts = kinds.options(path, line, header, kind, fewshot=False)
  metric_list = cfg.get("metric_list") or []
  line = lines.get("metric_list", 1)
  for entry in metric_list if isinstance(metric_list, list) else [metric_list]:
    plain = isinstance(entry, dict) and set(entry) <= {"metric", "aggregation", "higher_is_better"}
    if not plain or entry.get("metric") not in METRICS[kind] or entry.get("aggregation", "mean") \
        not in ("mean", "weighted_perplexity", "bits_per_byte"):
      raise kinds.error(path, line, f"'metric_list': {entry!r} is not supported; a {kind} task "
                                    f"computes {METRICS[kind]} (no metric options)")
  return opts


def _docs(path: str, files: list[str], convert, kind: str) -> list[dict]:
  return [kinds.check_doc(f, n, convert(f, n, doc), kind)
          for f in files for n, doc in kinds.read_jsonl(f)]


def load_task(path: str):
  """A Task from an lm-eval task YAML over local JSON Lines files."""
  cfg, lines = _read_yaml(path)
  _check_keys(path, cfg, lines)
  output_type = cfg.get("output_type", "generate_until")  # lm-eval's default
  if output_type not in KIND:
    raise kinds.error(path, lines.get("output_type", 1),
                      f"'output_type': {output_type!r} is not one of {tuple(KIND)}")
  kind = KIND[output_type]
  files = _data_files(path, cfg, lines)
  for key in SPLITS:
    if key in cfg and cfg[key] not in files:
      raise kinds.error(path, lines[key], f"{key!r}: {cfg[key]!r} is not a split of data_files "
                                          f"({', '.join(files)})")
  split = cfg.get("test_split", cfg.get("validation_split"))
  if split is None:
    raise kinds.error(path, 1, "needs 'test_split' or 'validation_split'")
  shots = next(cfg[k] for k in ("fewshot_split", "training_split", "validation_split", "test_split")
               if cfg.get(k) is not None)
  features = {k for f in files[split] for _, doc in kinds.read_jsonl(f) if isinstance(doc, dict)
              for k in doc}
  convert = _converter(path, cfg, lines, kind, features)
  options = _options(path, cfg, lines, kind)
  docs = _docs(path, files[split], convert, kind)
  if not docs:
    raise config_lib.ConfigError(f"{path}: split {split!r} has no records")
  fewshot = docs if shots == split else _docs(path, files[shots], convert, kind)
  name = cfg.get("task") or os.path.splitext(os.path.basename(path))[0]
  return kinds.Task(str(name), path, kind, docs, fewshot, cfg.get("target_delimiter", " "),
                    cfg.get("fewshot_delimiter", "\n\n"), options, cfg.get("num_fewshot", 0),
                    (cfg.get("fewshot_config") or {}).get("sampler", "default"),
                    cfg.get("fewshot_split") == cfg.get("test_split"))
