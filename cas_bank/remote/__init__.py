"""The shared tier: a Valkey cluster (or single server) that the banks of a fleet's
hosts publish to and restore from (`BankConfig.remote`). See `tier.RemoteTier`."""
