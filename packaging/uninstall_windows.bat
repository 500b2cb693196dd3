@echo off
rem Double-click to uninstall specchat: removes installer_files\ (environment, Python, caches) and
rem the shortcuts; this folder's own files and your conversations stay.
rem The steps are in windows\launcher.ps1 (PowerShell, which every Windows 10 and 11 has).
setlocal
rem Run from inside a ZIP that was not extracted, only this file is there.
if not exist "%~dp0windows\launcher.ps1" goto missing
powershell.exe -NoProfile -ExecutionPolicy Bypass -File "%~dp0windows\launcher.ps1" uninstall %*
set "status=%errorlevel%"
rem 0: done; 3: the launcher showed its error and waited for Enter; -1073741510: Ctrl+C.
if "%status%"=="0" exit /b 0
if "%status%"=="3" exit /b 1
if "%status%"=="-1073741510" exit /b 0
if "%SPECCHAT_UNATTENDED%"=="1" exit /b %status%
rem Anything else may be PowerShell's own failure (a script blocked by a policy, a file it
rem could not read), which nothing has explained or paused for: keep the window open.
echo.
echo specchat: windows\launcher.ps1 ended with exit code %status%: the lines above say why.
echo If they say that running scripts is disabled on this system, a policy of this computer
echo blocks PowerShell scripts: ask whoever manages it.
pause
exit /b %status%

:missing
echo specchat: windows\launcher.ps1 is missing next to this file.
echo If you opened this file inside the ZIP: Extract the whole ZIP first, then run this again
echo from the extracted folder.
if not "%SPECCHAT_UNATTENDED%"=="1" pause
exit /b 1
