"""Recipes: whole workflows built from colfunc's pieces (see each module)."""

from colfunc.recipes import domain_llm

__all__ = ["domain_llm"]
