"""Trainers built on the pipeline's public API.

- ``sac``: the soft actor-critic learner (torch only);
- ``collector``: the lock-step collector that steps a gymnasium vector env, adds to
  the replay buffer and serves pack requests between steps;
- ``shared``: the actor-weight ring and the episode log the two sides share;
- ``run``: the trainer itself (``SACConfig``, ``train``, ``compare``);
- ``report``: the results plot;
- ``cli``: the ``replay-fsm sac`` options (``benchmarks/sac_mujoco.py`` runs ``compare``).

gymnasium (and MuJoCo for its tasks) and matplotlib come with the ``mujoco`` extra.
"""
