def load_example(name: str):
    """``examples/<name>.py`` as a module (the folder is no package), registered in ``sys.modules``
    because dataclasses and pickling look their module up there."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"posttrain_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
