"""Training: the reference model, data, checkpoints, the training loop and the compare report.

    from lowprec.train import TrainConfig, build_model, compare, load_data, preset, train

    data = load_data()                                   # the embedded corpus, byte tokens
    model = build_model(preset("tiny"), seed=0)          # plain nn.Linear; train() converts it
    result = train(model, data, TrainConfig(recipe="mxfp8", steps=300), out_dir="runs/mxfp8")
    report = compare("tiny", "bf16,fp8-current,mxfp4", TrainConfig(steps=100), data, seeds=3,
                     out_dir="runs/cmp")

See ``docs/training.md``.
"""
from lowprec.train.checkpoint import (
                                      CheckpointError,
                                      latest_checkpoint,
                                      list_checkpoints,
                                      load_checkpoint,
                                      save_checkpoint,
)
from lowprec.train.compare import compare, parse_recipes
from lowprec.train.config import TrainConfig
from lowprec.train.corpus import Corpus, build_corpus
from lowprec.train.data import TokenData, load_data
from lowprec.train.loop import evaluate, train
from lowprec.train.model import PRESETS, ModelConfig, Transformer, build_model, preset
from lowprec.train.models import load_model
from lowprec.train.report import CompareReport, Thresholds
from lowprec.train.result import RunResult

__all__ = [
    "CheckpointError", "CompareReport", "Corpus", "ModelConfig", "PRESETS", "RunResult", "Thresholds", "TokenData",
    "TrainConfig", "Transformer", "build_corpus", "build_model", "compare", "evaluate", "latest_checkpoint",
    "list_checkpoints", "load_checkpoint", "load_data", "load_model", "parse_recipes", "preset", "save_checkpoint",
    "train",
]
