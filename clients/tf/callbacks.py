"""Horovod's ``horovod.tensorflow.keras.callbacks`` names for decent's Keras callbacks (so that
``import decent.tf as hvd`` then ``hvd.callbacks.BroadcastGlobalVariablesCallback(0)`` works)."""

from __future__ import annotations

from decent.tf.horovod import LearningRateWarmupCallback
from decent.tf.optim import BroadcastGlobalVariablesCallback, MetricAverageCallback

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateWarmupCallback",
           "MetricAverageCallback"]
