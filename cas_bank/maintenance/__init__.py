"""The maintenance tools: verify, salvage, explain and bundles."""
