"""Analysis of evaluation runs: metrics over EvalRecords, plots, and the Markdown/HTML report."""
