"""What the network runs: model loading, forward pass with hidden states, generation engine, sampler.

from models import load
from protocol.model_spec import TinyModelSpec
loaded = load(TinyModelSpec(seed=0))
"""

from models.loading import LoadedModel, load

__all__ = ["LoadedModel", "load"]
