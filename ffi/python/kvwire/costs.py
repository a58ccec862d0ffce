"""The router's cost model (``kvwire.cost/1`` files written by ``kvwire-bench calibrate``).

Pure Python, standard library only: a router can import it without the compiled engine.

The prediction, in seconds of ``decode_sent -> first_token``, is::

    t = fixed_s
      + bytes / bytes_per_s
      + layers * per_layer_tail_s
      + d_step_s * (1 + dst_running)
      + d_queue_s_per_waiting * dst_waiting
      + prefill_s_per_token * prefill_tokens
      + src_s_per_queued_token * src_queued_tokens
      + src_s_per_running_token * src_running_tokens
      + src_s_per_waiting * src_waiting
      + src_s_per_pending_byte * src_pending_bytes

evaluated left to right in double precision, exactly as the Rust side
(``kvwire_bench::costmodel``) does, so both agree to rounding. ``dst_waiting`` and
``dst_running`` are the requests waiting and running on the decode engine when the request is
sent there. The source (prefill engine) side: ``prefill_tokens`` are the tokens of this request
P still has to compute (prompt minus P's cached prefix; 0 when the KV is already on the
source), ``src_waiting`` the requests queued on P ahead of it, ``src_queued_tokens`` their
uncached tokens, ``src_running_tokens`` the uncached tokens of the step P is running that are
not computed yet, and ``src_pending_bytes`` the KV bytes P sends before this request's (what is
not yet sent of requests already prefilled, plus those running and queued ahead). The five
source-side terms are optional in a file (absent means 0), and the inputs default to 0.
``quantile`` picks the term set: ``"p50"`` (typical clock, fitted for the least relative error), ``"p90"`` (a clock 9
requests in 10 beat) or ``"mean"`` (the top-level least-squares terms).

Example::

    from kvwire.costs import CostModel
    m = CostModel.load("cost.json")
    t90 = m.predict(bytes=805306368, layers=48, dst_waiting=3, dst_running=40,
                    prefill_tokens=2500, src_waiting=2, src_queued_tokens=9000, quantile="p90")
"""

import json
import math

SCHEMA = "kvwire.cost/1"
TERM_NAMES = ("fixed_s", "bytes_per_s", "per_layer_tail_s", "d_step_s", "d_queue_s_per_waiting")
OPTIONAL_TERM_NAMES = (
    "prefill_s_per_token",
    "src_s_per_queued_token",
    "src_s_per_running_token",
    "src_s_per_waiting",
    "src_s_per_pending_byte",
)
ALL_TERM_NAMES = TERM_NAMES + OPTIONAL_TERM_NAMES
QUANTILES = ("mean", "p50", "p90")

__all__ = [
    "CostModel",
    "CostModelError",
    "Terms",
    "SCHEMA",
    "TERM_NAMES",
    "OPTIONAL_TERM_NAMES",
    "QUANTILES",
]


class CostModelError(ValueError):
    """A cost-model file that cannot be used: wrong schema, missing or invalid terms."""


def _number(value, where):
    # bool is an int subclass; a term of `true` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CostModelError(f"cost model term {where} = {value!r} is not a number")
    v = float(value)
    if not math.isfinite(v) or v < 0.0:
        raise CostModelError(f"cost model term {where} = {v!r} is not a finite non-negative number")
    return v


def _count(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CostModelError(f"{name} must be a non-negative integer, got {value!r}")
    return value


class Terms:
    """One set of terms: the five required ones and the five optional source-side ones."""

    __slots__ = ALL_TERM_NAMES

    def __init__(
        self,
        fixed_s,
        bytes_per_s,
        per_layer_tail_s,
        d_step_s,
        d_queue_s_per_waiting,
        prefill_s_per_token=0.0,
        src_s_per_queued_token=0.0,
        src_s_per_running_token=0.0,
        src_s_per_waiting=0.0,
        src_s_per_pending_byte=0.0,
    ):
        self.fixed_s = fixed_s
        self.bytes_per_s = bytes_per_s
        self.per_layer_tail_s = per_layer_tail_s
        self.d_step_s = d_step_s
        self.d_queue_s_per_waiting = d_queue_s_per_waiting
        self.prefill_s_per_token = prefill_s_per_token
        self.src_s_per_queued_token = src_s_per_queued_token
        self.src_s_per_running_token = src_s_per_running_token
        self.src_s_per_waiting = src_s_per_waiting
        self.src_s_per_pending_byte = src_s_per_pending_byte

    @classmethod
    def from_dict(cls, block, where):
        if not isinstance(block, dict):
            raise CostModelError(f"cost model lacks {where}")
        values = {}
        for name in TERM_NAMES:
            if block.get(name) is None:
                raise CostModelError(f"cost model lacks {where}.{name}")
            values[name] = _number(block[name], f"{where}.{name}")
        for name in OPTIONAL_TERM_NAMES:
            if name in block:
                values[name] = _number(block[name], f"{where}.{name}")
        if values["bytes_per_s"] <= 0.0:
            raise CostModelError(f"cost model term {where}.bytes_per_s must be > 0")
        return cls(**values)

    def to_dict(self):
        return {name: getattr(self, name) for name in ALL_TERM_NAMES}

    def predict(
        self,
        bytes,
        layers,
        dst_waiting,
        dst_running,
        prefill_tokens=0,
        src_waiting=0,
        src_queued_tokens=0,
        src_running_tokens=0,
        src_pending_bytes=0,
    ):
        """Seconds of ``decode_sent -> first_token`` (the module's formula, in its order)."""
        return (
            self.fixed_s
            + float(bytes) / self.bytes_per_s
            + float(layers) * self.per_layer_tail_s
            + self.d_step_s * (1.0 + float(dst_running))
            + self.d_queue_s_per_waiting * float(dst_waiting)
            + self.prefill_s_per_token * float(prefill_tokens)
            + self.src_s_per_queued_token * float(src_queued_tokens)
            + self.src_s_per_running_token * float(src_running_tokens)
            + self.src_s_per_waiting * float(src_waiting)
            + self.src_s_per_pending_byte * float(src_pending_bytes)
        )

    def __repr__(self):
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in ALL_TERM_NAMES)
        return f"Terms({inner})"


class CostModel:
    """A loaded, validated ``kvwire.cost/1`` model."""

    def __init__(self, data):
        if not isinstance(data, dict):
            raise CostModelError("cost model is not a JSON object")
        if "schema" not in data:
            raise CostModelError("cost model lacks schema")
        if data["schema"] != SCHEMA:
            raise CostModelError(f"cost model schema is {data['schema']!r}, expected {SCHEMA!r}")
        for key in ("transport", "fitted_on", "terms", "quantiles", "error"):
            if key not in data:
                raise CostModelError(f"cost model lacks {key}")
        quantiles = data["quantiles"]
        if not isinstance(quantiles, dict):
            raise CostModelError("cost model lacks quantiles.p50")
        self.transport = str(data["transport"])
        self.fitted_on = data["fitted_on"]
        self.terms = {
            "mean": Terms.from_dict(data["terms"], "terms"),
            "p50": Terms.from_dict(quantiles.get("p50"), "quantiles.p50"),
            "p90": Terms.from_dict(quantiles.get("p90"), "quantiles.p90"),
        }
        err = data["error"]
        if not isinstance(err, dict):
            raise CostModelError("cost model lacks error.p50_rel")
        for key in ("p50_rel", "p90_rel"):
            if key not in err:
                raise CostModelError(f"cost model lacks error.{key}")
            _number(err[key], f"error.{key}")
        self.error = err
        self.data = data

    @classmethod
    def loads(cls, text):
        """Parses a model from JSON text."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise CostModelError(f"cost model is not valid JSON: {e}") from e
        return cls(data)

    @classmethod
    def load(cls, path):
        """Reads a model file."""
        with open(path, "r", encoding="utf-8") as f:
            return cls.loads(f.read())

    def predict(
        self,
        bytes,
        layers,
        dst_waiting=0,
        dst_running=0,
        quantile="p50",
        *,
        prefill_tokens=0,
        src_waiting=0,
        src_queued_tokens=0,
        src_running_tokens=0,
        src_pending_bytes=0,
    ):
        """Predicted seconds of ``decode_sent -> first_token``; keyword use recommended.

        The source-side inputs (keyword only) default to 0: a router that does not know them
        gets the destination-only prediction.
        """
        if quantile not in self.terms:
            raise CostModelError(f"quantile must be one of {QUANTILES}, got {quantile!r}")
        return self.terms[quantile].predict(
            _count(bytes, "bytes"),
            _count(layers, "layers"),
            _count(dst_waiting, "dst_waiting"),
            _count(dst_running, "dst_running"),
            _count(prefill_tokens, "prefill_tokens"),
            _count(src_waiting, "src_waiting"),
            _count(src_queued_tokens, "src_queued_tokens"),
            _count(src_running_tokens, "src_running_tokens"),
            _count(src_pending_bytes, "src_pending_bytes"),
        )

    def __repr__(self):
        return f"CostModel(transport={self.transport!r}, p50={self.terms['p50']!r})"
