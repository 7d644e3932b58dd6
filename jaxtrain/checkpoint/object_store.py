"""Checkpoint tiers on S3-compatible object storage: `checkpoint.dir=s3://bucket/prefix`.

Orbax writes a step's small files (metadata, JSON items, the commit marker) through etils.epath,
which reaches S3 through fsspec's s3fs, and the arrays through TensorStore. orbax-checkpoint 0.12.8
builds TensorStore specs for `gs://` and local paths only: an `s3://` directory fails at the first
array with `ValueError: Checkpoint path should be absolute. Got s3:/bucket/...`. `install` teaches
its spec builder TensorStore's own `s3` kvstore driver, and nothing else changes for other paths.

S3 has no rename, so an S3 tier commits as Orbax commits on GCS: a step is written in place and is
complete once its `commit_success.txt` exists (`atomicity`); a step without one (a process killed
mid-upload) is never listed, and is deleted at the next start.

Where: the endpoint is `checkpoint.s3_endpoint`, else the environment's `AWS_ENDPOINT_URL_S3` or
`AWS_ENDPOINT_URL` (as boto3 reads them), else AWS itself; the region `AWS_REGION` or
`AWS_DEFAULT_REGION`; credentials as boto3 finds them (environment, profile files, an instance or
container role), handed to TensorStore as the same source. `check` probes all of it at start.
"""

import functools
import os

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.path import gcs_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from jaxtrain.config import ConfigError

PREFIX = "s3://"
COMMIT_FILE = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
# botocore's credential sources -> TensorStore's aws_credentials types
_SOURCES = {"env": "environment", "shared-credentials-file": "profile", "config-file": "profile",
            "iam-role": "imds", "container-role": "ecs"}


def is_s3(directory: str) -> bool:
  return str(directory).startswith(PREFIX)


def split(url: str) -> tuple[str, str]:
  """s3://bucket/a/b -> ("bucket", "a/b")."""
  bucket, _, key = url[len(PREFIX):].partition("/")
  return bucket, key.strip("/")


def endpoint(k) -> str | None:
  """The S3 endpoint URL of the `checkpoint` config section `k`; None: AWS's own."""
  return (k.get("s3_endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3")
          or os.environ.get("AWS_ENDPOINT_URL") or None)


def _region() -> str | None:
  return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None


# ---- the setup every S3 tier shares (process-wide: Orbax's spec builder, fsspec's s3 options) ----

_setup = {"endpoint": None, "credentials": {"type": "default"}, "installed": False}


def configure(k) -> None:
  """Points Orbax (TensorStore) and epath (s3fs) at the endpoint of `k` for every `s3://` path;
  one ConfigError line when s3fs is missing."""
  try:
    import fsspec
    import s3fs  # noqa: F401  (epath's s3:// backend)
    import botocore.session
  except ImportError as e:
    raise ConfigError(f"checkpoint directories on s3:// need s3fs ({e}): pip install "
                      "'jaxtrain[s3]'") from e
  url = endpoint(k)
  source = botocore.session.get_session().get_credentials()
  credentials = {"type": _SOURCES.get(getattr(source, "method", None), "default")}
  if credentials["type"] == "profile" and os.environ.get("AWS_PROFILE"):
    credentials["profile"] = os.environ["AWS_PROFILE"]
  options = {"use_listings_cache": False, **({"endpoint_url": url} if url else {})}
  if fsspec.config.conf.get("s3") != options:
    fsspec.config.conf["s3"] = options  # epath asks fsspec for "s3" with no arguments
    epath.backend.fsspec_backend._get_filesystem.cache_clear()  # noqa: SLF001 (etils' cache)
  _setup.update(endpoint=url, credentials=credentials)
  install()


def tensorstore_spec(url: str) -> dict:
  """TensorStore's kvstore spec of an s3:// directory."""
  bucket, key = split(url)
  spec = {"driver": "s3", "bucket": bucket, "path": key + "/" if key else "",
          "aws_credentials": dict(_setup["credentials"])}
  if _setup["endpoint"]:
    spec["endpoint"] = _setup["endpoint"]
  if _region():
    spec["aws_region"] = _region()
  return spec


def install() -> None:
  """Orbax's kvstore spec builder, for `s3://` paths as for `gs://` ones but on TensorStore's s3
  driver: the three helpers it branches on, each unchanged for any other path."""
  if _setup["installed"]:
    return
  normalize, use_gcs, for_gcs = (ts_utils._normalize_path, ts_utils._use_gcs_driver,  # noqa: SLF001
                                 gcs_utils.get_kvstore_for_gcs)

  @functools.wraps(normalize)
  def normalize_path(path: str) -> str:
    return PREFIX + os.path.normpath(path[len(PREFIX):]) if is_s3(path) else normalize(path)

  @functools.wraps(use_gcs)
  def use_remote_driver(directory: str) -> bool:
    return is_s3(directory) or use_gcs(directory)

  @functools.wraps(for_gcs)
  def kvstore_for(path: str) -> dict:
    return tensorstore_spec(path) if is_s3(path) else for_gcs(path)

  ts_utils._normalize_path = normalize_path  # noqa: SLF001
  ts_utils._use_gcs_driver = use_remote_driver  # noqa: SLF001
  gcs_utils.get_kvstore_for_gcs = kvstore_for
  _setup["installed"] = True


# ---- the probe at start: one line, before anything trains ----

def check(what: str, url: str, k) -> None:
  """One ConfigError line unless the bucket of `url` is reachable at the endpoint of `k`, found,
  and writable with the credentials found; writes and deletes one small object."""
  configure(k)
  import botocore.config
  import botocore.exceptions
  import botocore.session
  bucket, key = split(url)
  where = endpoint(k) or "AWS's default endpoint"
  if len(bucket) < 3:
    raise ConfigError(f"{what} at {url}: not a bucket name")
  session = botocore.session.get_session()
  if session.get_credentials() is None:
    raise ConfigError(f"{what} at {url}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                      "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run with an instance role)")
  client = session.create_client(
      "s3", endpoint_url=endpoint(k), region_name=_region() or "us-east-1",
      config=botocore.config.Config(connect_timeout=5, read_timeout=20,
                                    retries={"total_max_attempts": 2}))
  probe = f"{key}/.jaxtrain-probe-{jax.process_index()}".lstrip("/")
  try:
    client.head_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key=probe, Body=b"")
    client.delete_object(Bucket=bucket, Key=probe)
  except (botocore.exceptions.EndpointConnectionError,
          botocore.exceptions.ConnectTimeoutError) as e:
    raise ConfigError(f"{what} at {url}: cannot reach the S3 endpoint {where} ({e})") from e
  except botocore.exceptions.ClientError as e:
    code = e.response.get("Error", {}).get("Code", "")
    if code in ("404", "NoSuchBucket"):
      raise ConfigError(f"{what} at {url}: bucket '{bucket}' does not exist at {where}") from e
    if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
      raise ConfigError(f"{what} at {url}: access denied to bucket '{bucket}' at {where} "
                        f"({code}): check the credentials") from e
    raise ConfigError(f"{what} at {url}: {' '.join(str(e).split())}") from e
  except botocore.exceptions.BotoCoreError as e:
    raise ConfigError(f"{what} at {url}: {' '.join(str(e).split())}") from e
