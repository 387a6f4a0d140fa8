"""The data plane: the shared replay buffer, the sampling contract, channels and
the packer. Imports the protocol layer only."""
