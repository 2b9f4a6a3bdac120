"""The search task: a corpus, its BM25 and dense retrievers, the retriever server, the environment."""
