"""Generation (eval/generate.py) through the KV-cache sampler against a plain greedy argmax loop of
full forward passes; stop ids and stop strings cut; the generate, code and dialogue task kinds end
to end on a random byte model; answer extraction and SQuAD token F1 by hand."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import config as config_lib, parallel
from jaxtrain.data.tokenizers import Bytes
from jaxtrain.eval import evaluate, generate, metrics, score
from jaxtrain.model import ModelConfig, Transformer
from tests.eval.conftest import assert_bad_task_file, write_jsonl
from tests.fixtures import tiny_config

N = 8  # new tokens
# untied and of larger weights: the tied random model's greedy choice repeats the last token forever
MODEL = {"vocab_size": 260, "tie_embeddings": False, "init_std": 0.5}


@pytest.fixture(scope="module")
def byte_model():
  """A random float32 byte-level model (vocab 260, max_seq_len 32, untied), its params and a
  Generator of 4 rows."""
  cfg = ModelConfig.from_config(tiny_config(model=MODEL).model)
  module = Transformer(cfg)
  params = jax.tree.map(np.asarray, nn.unbox(
      jax.jit(module.init)(jax.random.key(2), jnp.zeros((1, 8), jnp.int32))["params"]))
  return cfg, module, params, generate.Generator(score.Scorer(cfg, params, rows=4))


def greedy_reference(module, params, prompt_ids, n=N, width=32) -> np.ndarray:
  """n tokens, each the argmax of a full forward pass over everything so far (no cache, no left
  padding; the right padding to `width` slots cannot reach back through causal attention, and keeps
  one compilation)."""
  ids = list(prompt_ids)
  for _ in range(n):
    tokens_1L = np.zeros((1, width), np.int32)
    tokens_1L[0, :len(ids)] = ids
    ids.append(int(np.argmax(np.asarray(APPLY(module, params, tokens_1L))[0, len(ids) - 1])))
  return np.asarray(ids[len(prompt_ids):], np.int32)


APPLY = jax.jit(lambda module, params, tokens_1L: module.apply({"params": params}, tokens_1L),
                static_argnums=0)


PROMPTS = ["The answer is", "a", "Two plus two is four", "xyz", "Once upon a time"]


def test_greedy_generation_equals_a_plain_argmax_loop(byte_model):
  """Five prompts of different lengths over two left-padded batches of 4 rows."""
  _, module, params, gen = byte_model
  prompts = [np.concatenate([[256], Bytes().encode(p)]).astype(np.int32) for p in PROMPTS]
  got, cut = gen(prompts, N)
  assert cut == 0
  for p, ids in zip(prompts, got):
    np.testing.assert_array_equal(ids, greedy_reference(module, params, p))


def test_generation_on_a_mesh_equals_one_device(byte_model):
  """Rows over the data axes (3 rows round up to 8), params sharded by the fsdp rules: the same
  greedy ids."""
  cfg, _, params, gen = byte_model
  mesh = parallel.make_mesh(tiny_config(mesh={"data": 2, "fsdp": -1}).mesh)
  sharded = generate.Generator(score.Scorer(cfg, params, rows=3, mesh=mesh))
  prompts = [np.concatenate([[256], Bytes().encode(p)]).astype(np.int32) for p in PROMPTS]
  want, got = gen(prompts, N)[0], sharded(prompts, N)[0]
  assert sharded.rows == 8 and all(np.array_equal(a, b) for a, b in zip(want, got))


def test_a_stop_id_cuts_and_long_prompts_are_cut_from_the_left(byte_model):
  _, module, params, gen = byte_model
  prompt = np.concatenate([[256], Bytes().encode(PROMPTS[0])]).astype(np.int32)
  ref = greedy_reference(module, params, prompt)
  stop = int(ref[3])
  got, _ = gen([prompt], N, stop_ids=(stop,))
  np.testing.assert_array_equal(got[0], ref[:list(ref).index(stop)])
  long = np.concatenate([[256], Bytes().encode("z" * 40 + PROMPTS[0])]).astype(np.int32)
  got, cut = gen([long], N)
  assert cut == 1
  np.testing.assert_array_equal(got[0], greedy_reference(module, params, long[-(32 - N):]))
  with pytest.raises(config_lib.ConfigError, match="max_new_tokens=32 must be in"):
    gen([prompt], 32)


def test_sampling_is_reproducible_by_seed(byte_model):
  _, _, _, gen = byte_model
  prompts = [np.concatenate([[256], Bytes().encode(p)]).astype(np.int32) for p in PROMPTS[:2]]
  a, b = (gen(prompts, N, temperature=1.0, seed=s)[0] for s in (0, 0))
  c = gen(prompts, N, temperature=1.0, seed=1)[0]
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_generate_task_exact_match_after_stop_strings(tmp_path, byte_model):
  """The gold answer of doc 0 is the greedy text up to a stop string taken from its middle (its
  first occurrence, so the stop must cut for a match); doc 1's gold is wrong: exact_match 0.5."""
  cfg, module, params, _ = byte_model
  prompt = np.concatenate([[256], Bytes().encode(PROMPTS[4])]).astype(np.int32)
  text = Bytes().decode(greedy_reference(module, params, prompt))
  k = next(k for k in range(2, len(text)) if text.find(text[k]) == k and text[:k].strip())
  stop, answer = text[k], text[:k].strip()
  assert generate.cut_at_stop(text, [stop]).strip() == answer and not metrics.is_number(answer)
  path = write_jsonl(tmp_path / "gen.jsonl", [
      {"task": {"kind": "generate", "until": [stop], "max_new_tokens": N}},
      {"context": PROMPTS[4], "answer": answer}, {"context": PROMPTS[4], "answer": answer + "!"}])
  got = evaluate(params, [path], config=cfg, tokenizer=Bytes())["gen"]
  assert (got["exact_match"], got["docs"], got["truncated"]) == (0.5, 2, 0)


@pytest.mark.parametrize("text, gold, regex, expected", [
    ("so 3 + 4 = 7. The answer is 1,234.", "1234", None, 1.0),  # last number, commas dropped
    ("The answer is $1,234.\n", "1,234", None, 1.0),
    ("first 12 then 13", "12", None, 0.0),
    ("#### 42 and then 7", "42", r"#### (-?[\d,.]+)", 1.0),
    ("  Paris  ", "Paris", None, 1.0),
    ("Paris, France", "Paris", None, 0.0),
    ("no number here", "5", None, 0.0),
])
def test_exact_match_after_answer_extraction(text, gold, regex, expected):
  assert metrics.exact_match(text, gold, regex) == expected


def test_squad_token_f1_by_hand():
  # tokens "cat sat on mat" vs "cat sat": 2 common, precision 1, recall 1/2, F1 2/3 (articles and
  # punctuation go)
  assert metrics.token_f1("The cat sat!", "A cat sat on the mat.") == pytest.approx(2 / 3)
  assert metrics.token_f1("", "") == 1.0 and metrics.token_f1("dog", "") == 0.0
  assert metrics.token_f1("Dog dog", "dog") == pytest.approx(2 / 3)


def test_code_task_pass_at_k_counts_passes_failures_and_timeouts(tmp_path, byte_model):
  """Sampled completions land in a comment (stop at the line's end), so the tests alone decide: a
  passing, a failing and a hanging test, three samples each."""
  cfg, _, params, _ = byte_model
  path = write_jsonl(tmp_path / "code.jsonl", [
      {"task": {"kind": "code", "n": 3, "k": [1, 2], "temperature": 1.0, "max_new_tokens": N,
                "until": ["\n", "\r", "\x00"], "timeout_s": 0.5}},
      {"prompt": "def f():\n  return 1\n#", "tests": "def check(g):\n  assert g() == 1\n",
       "entry_point": "f"},
      {"prompt": "#", "tests": "assert 1 == 2\n"},
      {"prompt": "#", "tests": "while True:\n  pass\n"}])
  got = evaluate(params, [path], config=cfg, tokenizer=Bytes())["code"]
  assert got["pass@1"] == pytest.approx(1 / 3) and got["pass@2"] == pytest.approx(1 / 3)
  assert (got["docs"], got["samples"], got["timeouts"]) == (3, 9, 3)


def test_dialogue_prompt_through_the_chat_template_and_reply_scores(tmp_path):
  """Bytes has no chat template: the default one (posttrain/data.py); the greedy reply is doc 0's
  reference (a model of 64 positions, for the two turns' prompt)."""
  cfg = ModelConfig.from_config(tiny_config(model={**MODEL, "max_seq_len": 64}).model)
  module = Transformer(cfg)
  params = jax.tree.map(np.asarray, nn.unbox(
      jax.jit(module.init)(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))["params"]))
  messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
              {"role": "user", "content": "ok?"}]
  from jaxtrain.posttrain import data as post_data
  prompt, end = generate.chat_prompt(post_data.Encoder(Bytes(), 64), messages)
  assert end == (Bytes().eos,)
  expected = "<|user|>\nhi\n<|assistant|>\nyo"
  np.testing.assert_array_equal(prompt[:1 + len(expected)],
                                np.concatenate([[256], Bytes().encode(expected)]))
  assert Bytes().decode(prompt) == expected + "<|user|>\nok?\n<|assistant|>\n"
  reply = Bytes().decode(greedy_reference(module, params, prompt, 6, width=64))
  assert reply.strip()
  path = write_jsonl(tmp_path / "chat.jsonl", [
      {"task": {"kind": "dialogue", "max_new_tokens": 6}},
      {"messages": messages, "reference": reply},
      {"messages": messages, "reference": reply + " extra"}])
  got = evaluate(params, [path], config=cfg, tokenizer=Bytes())["chat"]
  assert (got["exact_match"], got["truncated"]) == (0.5, 0)
  assert got["f1"] == pytest.approx((1 + metrics.token_f1(reply, reply + " extra")) / 2)


@pytest.mark.slow  # trains a reward model for 2 steps (~15 s)
def test_dialogue_scored_by_a_reward_model_run(tmp_path):
  """The header's reward_model (a train.task=rm run beside the task file) scores each conversation
  with the generated reply and with the reference: the same numbers as the run's RewardFunction on
  those conversations, and its win rate from them."""
  import jaxtrain
  from tests.posttrain.test_reward import marker_pairs
  pairs = tmp_path / "pairs.jsonl"
  pairs.write_text("".join(json.dumps(r) + "\n" for r in marker_pairs(64, 0)))
  rm_cfg = tiny_config(model={"vocab_size": 260, "max_seq_len": 96}, data={"kind": "bytes"},
                       train={"task": "rm", "seq_len": 48, "batch_size": 8, "steps": 2},
                       posttrain={"train_path": str(pairs), "eval_path": str(pairs)})
  jaxtrain.train(rm_cfg, str(tmp_path / "rm"), progress=False)
  cfg = ModelConfig.from_config(tiny_config(model={**MODEL, "max_seq_len": 64}).model)
  module = Transformer(cfg)
  params = jax.tree.map(np.asarray, nn.unbox(
      jax.jit(module.init)(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))["params"]))
  docs = [{"messages": [{"role": "user", "content": f"< {i} 2 |"}], "reference": f"{i} 39 >"}
          for i in range(4)]
  path = write_jsonl(tmp_path / "chat.jsonl",
                     [{"task": {"kind": "dialogue", "max_new_tokens": 6, "reward_model": "rm"}},
                      *docs])
  got = evaluate(params, [path], config=cfg, tokenizer=Bytes())["chat"]
  from jaxtrain.posttrain import data as post_data
  encoder = post_data.Encoder(Bytes(), 64)
  replies = [Bytes().decode(greedy_reference(
      module, params, generate.chat_prompt(encoder, d["messages"])[0], 6, width=64)).strip()
      for d in docs]
  assert all(replies), replies  # 6 greedy bytes of an init_std 0.5 model: never blank here
  rm = jaxtrain.load_reward_model(str(tmp_path / "rm"))
  conversation = lambda d, reply: [*d["messages"], {"role": "assistant", "content": reply}]
  want = rm.chats([conversation(d, r) for d, r in zip(docs, replies)])
  ref = rm.chats([conversation(d, d["reference"]) for d in docs])
  assert got["reward_empty"] == 0
  assert got["reward"] == pytest.approx(float(np.mean(want)), rel=1e-5)
  assert got["reward_reference"] == pytest.approx(float(np.mean(ref)), rel=1e-5)
  assert got["reward_win_rate"] == float(np.mean(want > ref))
  bad = write_jsonl(tmp_path / "bad.jsonl",
                    [{"task": {"kind": "dialogue", "max_new_tokens": 2, "reward_model": "none"}},
                     docs[0]])
  with pytest.raises(config_lib.ConfigError, match="reward_model: no such run directory"):
    evaluate(params, [bad], config=cfg, tokenizer=Bytes())


@pytest.mark.parametrize("lines, message", [
    ([{"task": {"kind": "generate", "until": "\n"}}, {"context": "a", "answer": "b"}],
     "1: the header's 'until' must be a list of strings"),
    ([{"task": {"kind": "code", "n": 2, "k": [1, 3]}}, {"prompt": "#", "tests": "pass"}],
     "1: code: every k must be <= n=2"),
    ([{"task": {"kind": "code", "labels": ["a"]}}, {"prompt": "#", "tests": "pass"}],
     "1: the header's 'labels' is not an option of a code task"),
    ([{"context": "a", "answer": 3}], "1: generate: needs a string field 'answer'"),
    ([{"prompt": "x", "tests": ""}], "1: code: needs a string field 'tests'"),
    ([{"messages": [{"role": "assistant", "content": "hi"}], "reference": "x"}],
     "1: dialogue: 'messages' must be a non-empty list"),
    ([{"task": {"kind": "generate", "answer_regex": "("}}, {"context": "a", "answer": "b"}],
     "1: answer_regex does not compile"),
])
def test_bad_generative_files_are_one_error_line(tmp_path, lines, message):
  assert_bad_task_file(tmp_path, lines, message)


def test_a_tokenizers_own_chat_template_gives_the_prompt_and_its_end_of_turn_token(tmp_path):
  """A template whose turns end with "<pad>" (a special token, id 2) rather than EOS: generation
  stops there."""
  from jaxtrain.data import tokenizers
  from jaxtrain.posttrain import data as post_data
  path = str(tmp_path / "tokenizer.json")
  tok = tokenizers.train_bpe(["hello there, how are you", "fine thanks"] * 20, 300, path)
  template = ("{{ bos_token }}{% for m in messages %}"
              "{{ m.role }}: {{ m.content }}<pad>\n{% endfor %}"
              "{% if add_generation_prompt %}assistant: {% endif %}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"},
              {"role": "user", "content": "how are you"}]
  prompt, end = generate.chat_prompt(post_data.Encoder(tok, 256), messages)
  assert end == (2,) and prompt[0] == tok.bos and (prompt == 2).sum() == 3
  assert tok.decode(prompt) == "user: hello\nassistant: fine\nuser: how are you\nassistant: "
