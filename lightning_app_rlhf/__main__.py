from lightning_app_rlhf.cli import main

if __name__ == "__main__":
    main()
