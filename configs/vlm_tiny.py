"""Image-text training (train.task=vlm) on the generated shapes task (jaxtrain/data/shapes.py): a
2-layer ViT over 16x16 RGB images (16 patches of 4x4), LLaVA's projector and a 2-layer decoder answer
"shape?" or "colour?" with one token, on a 2-core CPU. Chance without the image is 1/4.
Measured: tests/core/test_vlm.py and the README's image-text section.
"""

from jaxtrain.config import default_config


def get_config(arg=None):
  del arg
  c = default_config()
  # vocab 64 > the shapes data's 12 ids: the image placeholder is id 63 (image_token=-1)
  c.model.update(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16,
                 d_ff=256, max_seq_len=32, scan_layers=False)
  c.model.vision.update(image_size=16, patch_size=4, channels=3, d_model=64, n_layers=2, n_heads=4)
  c.train.update(task="vlm", steps=800, batch_size=32, seq_len=18, log_every=50, eval_every=400,
                 eval_batches=8)
  c.optim.update(lr=1e-3, warmup_steps=50, schedule="cosine")
  c.mesh.update(data=-1)
  return c
