"""The write path: a store's steps, the background writer, transactions and admission."""
