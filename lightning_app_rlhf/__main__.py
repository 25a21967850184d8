from lightning_app_rlhf.cli import main

if __name__ == "__main__":
    main(prog="python -m lightning_app_rlhf")
