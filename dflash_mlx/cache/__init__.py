"""Prompt caches: a conversation's reusable state and the shared block store on disk."""
