from config_service.main import main

if __name__ == "__main__":
    main()
