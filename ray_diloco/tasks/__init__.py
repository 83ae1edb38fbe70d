"""Layer: tasks (pure, no Ray). What gets trained, behind the task contract of
`ray_diloco/task.py`: the built-in models and data sources. Nothing outside this package
knows a model's shape or a dataset's format."""
