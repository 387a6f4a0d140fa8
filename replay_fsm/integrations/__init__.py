"""Adapters that let other RL libraries use the pipeline.

- ``sb3``: ``PipelineReplayBuffer``, a Stable-Baselines3 replay buffer (the ``sb3``
  extra: ``pip install 'replay-fsm[sb3]'``).
"""
