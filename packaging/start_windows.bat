@echo off
rem Double-click to open specchat: the first run installs it into this folder (installer_files\),
rem later runs start it at once. Arguments go on to specchat, e.g. --port 8000 --no-browser.
rem SPECCHAT_UNATTENDED=1 installs without asking anything; SPECCHAT_DRY_RUN=1 prints every step.
rem The steps are in windows\launcher.ps1 (PowerShell, which every Windows 10 and 11 has).
setlocal
powershell.exe -NoProfile -ExecutionPolicy Bypass -File "%~dp0windows\launcher.ps1" start %*
exit /b %errorlevel%
