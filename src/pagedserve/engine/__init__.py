"""The engine: step loop, request bookkeeping, incremental detokenization and the offline API."""
